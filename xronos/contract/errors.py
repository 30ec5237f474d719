"""The one error type the command line turns into a one-line message.

Anything a user can get wrong (a path, a split, a flag) raises `XronosError`
with a sentence that names the problem; `xronos.cli.main` prints it as
`xronos: error: ...` and exits non-zero, never with a traceback.
"""


class XronosError(Exception):
    """A user-facing error: the message is the whole story."""
