"""The frozen app's entry point (PyInstaller runs this file as __main__): the same
`reprise` command the wheel installs, GUI with no arguments, subcommands otherwise.
A frozen app cannot run `python -m`, so the GGUF import child (app/engine/gguf_child.py)
starts this executable again with one hidden argument."""

import sys

if __name__ == "__main__":
    if sys.argv[1:] == ["--gguf-import-child"]:
        from app.engine.gguf_child import run_child

        sys.exit(run_child())
    from app.cli import main

    sys.exit(main())
