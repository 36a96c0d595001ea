"""The use cases, Qt-free: the one writer of conversations, caches and preferences."""
