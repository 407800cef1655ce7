"""The command line of a test driver that starts a test binary's helper.

Helper processes are modes of the unity test binaries
(`BINARY --helper NAME ARGS...`, support/helper_main.hpp), so a driver
takes its own arguments, then `--`, then the helper's command.
"""

import pathlib
import sys


def split_command(argv):
    """(the arguments before `--`, the helper's command after it); exits
    with a usage line when there is no `--` or nothing after it."""
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        sys.exit(f"usage: {pathlib.Path(argv[0]).name} ... -- HELPER_COMMAND [ARGS...]")
    at = argv.index("--")
    return argv[1:at], argv[at + 1:]
