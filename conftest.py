# Repository-root conftest: pytest puts its folder, the repository root, on sys.path, so the tests
# import this checkout's dcp_pass whichever copy is installed.
