"""Everything that runs on the generation thread: the worker, the batching scheduler, sampling,
stops.

Nothing here knows about HTTP: `QueueFull` is an engine condition, reported as the server sees fit.
"""

from hotlora.server.engine.batch_check import check_batching
from hotlora.server.engine.fair_share import Share
from hotlora.server.engine.generate import (
    Delta,
    Engine,
    Event,
    Finished,
    GenerationJob,
    NonFiniteLogits,
    SampledToken,
)
from hotlora.server.engine.grammar import GrammarFailed
from hotlora.server.engine.sampling import SamplingParams
from hotlora.server.engine.scheduler import Scheduler
from hotlora.server.engine.worker import (
    ClientNotReading,
    GenerationWorker,
    LoadSnapshot,
    QueueFull,
    Ticket,
    WorkerStopped,
)

__all__ = [
    "ClientNotReading",
    "Delta",
    "Engine",
    "Event",
    "Finished",
    "GenerationJob",
    "GenerationWorker",
    "GrammarFailed",
    "LoadSnapshot",
    "NonFiniteLogits",
    "QueueFull",
    "SampledToken",
    "SamplingParams",
    "Scheduler",
    "Share",
    "Ticket",
    "WorkerStopped",
    "check_batching",
]
