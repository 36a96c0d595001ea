"""The frozen app's entry point (PyInstaller runs this file as __main__): the same
`reprise` command the wheel installs, GUI with no arguments, subcommands otherwise."""

import sys

from app.cli import main

if __name__ == "__main__":
    sys.exit(main())
