"""API tests: the OpenAI-compatible server against a scripted FakeEngine and, end to end, the tiny model."""
