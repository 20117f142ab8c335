"""The one exception type that reaches users as a one-line message."""


class UserError(Exception):
    """A problem with the user's input (config, files, options).

    The CLI prints ``error: <message>`` on one line and exits with status 2, so the
    message must name the problem and the fix, e.g.
    ``model.preset='XXL' is not a preset; choose one of: tiny, S, B, XL``.
    """
