"""The one exception the model side raises for bad model inputs."""

from __future__ import annotations


class ModelLoadError(Exception):
    """A model could not be found, read or mapped onto the forward.

    The message always names the file (and the tensor or key, where one is at fault), so a user
    can act on it without reading a traceback from deep inside a parser.
    """
