"""LoRA adapters over one base model: mounted, unmounted and selected per request.

`spec` parses a request's selection, `files` and `pairs` validate adapter directories against
the base, `lora` holds the slots and the per-call active set, `manager` is the registry, and
`fuse` merges an adapter into a copy of the weights. Import from those modules directly.
"""
