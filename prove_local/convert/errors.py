"""The one exception the converter raises for bad input."""


class ConvertError(Exception):
    """A problem with the input checkpoint or the request; the message names the file, key or tensor."""
