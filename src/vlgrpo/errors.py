"""The base of every error vlgrpo raises for bad input: the CLIs print its message, no traceback."""


class VlgrpoError(Exception):
    """A problem with the user's config, data, model folder or checkpoints; the message names it."""


class DataError(VlgrpoError, ValueError):
    """Unusable data, template or model folder; the message names the problem."""
