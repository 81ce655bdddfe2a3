"""The base of every error vlgrpo raises for bad input: the CLIs print its message, no traceback."""


class VlgrpoError(Exception):
    """A problem with the user's config, data, model folder or checkpoints; the message names it."""
