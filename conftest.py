# Repository-root conftest: puts the root on sys.path so `examples` imports in tests.
