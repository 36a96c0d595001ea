"""The desktop window: widgets only; the engine runs in app.worker."""
