"""HTTP tier: the app in-process under a TestClient, with the real engine on the tiny model."""
