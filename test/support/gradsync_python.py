"""The Python side of the safetensors interop tests: run under GRADSYNC_PYTHON.

The tests that open gradsync's files with Python's safetensors package run
under the interpreter in GRADSYNC_PYTHON (default /usr/bin/python3;
tools/python-venv makes one), and skip (exit 77) where it cannot import
safetensors and numpy.
"""

import os
import shutil
import sys

SKIP = 77


def under_gradsync_python(script, hint=""):
    """Re-executes `script` under GRADSYNC_PYTHON unless it runs there already.

    Returns SKIP, having said why, when that interpreter is missing or cannot
    import safetensors and numpy; None when the script may go on.
    """
    python = os.environ.get("GRADSYNC_PYTHON", "/usr/bin/python3")
    # Not realpath: a venv's python is a symlink to the system one.
    if os.path.abspath(sys.executable) != os.path.abspath(python) and not os.environ.get("_GRADSYNC_REEXEC"):
        if not shutil.which(python):
            print(f"SKIP: GRADSYNC_PYTHON={python} does not exist")
            return SKIP
        os.environ["_GRADSYNC_REEXEC"] = "1"
        os.execv(python, [python, os.path.abspath(script)] + sys.argv[1:])
    try:
        import numpy  # noqa: F401
        import safetensors.numpy  # noqa: F401
    except ImportError as e:
        print(f"SKIP: {sys.executable} cannot import safetensors and numpy ({e}){hint}")
        return SKIP
    return None
