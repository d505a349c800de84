"""User-facing errors.

Anything the user can fix (a bad config key, a missing file, a corrupt checkpoint) is raised as
`LmforgeError` with one line that names the problem and what to do. The CLI prints that line and
exits with status 2; any other exception is a bug and keeps its traceback.
"""


class LmforgeError(Exception):
    """An error caused by user input, reported as one line without a traceback."""
