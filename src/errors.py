"""The one exception type for failures a user can cause and fix (bad data, checkpoint, config, device)."""


class UserError(Exception):
    """A failure the user can fix: the message is one line naming the file or key and what to do.

    Top-level scripts print it as a single line and exit non-zero instead of showing a traceback.
    """
