"""Exceptions users see. Every message names the thing that is wrong and what is allowed."""


class FlashtreeError(Exception):
    """Base class for errors caused by user input (paths, configs, requests)."""

    exit_code = 2  # what the command line exits with


class AddressInUseError(FlashtreeError):
    """The server's address (host and port) is taken by another process."""

    exit_code = 1


class ConfigError(FlashtreeError, ValueError):
    """A config file or option has a missing or invalid value."""


class CheckpointError(FlashtreeError):
    """A checkpoint (directory, safetensors, GGUF, hub id) cannot be loaded."""


class RequestError(FlashtreeError, ValueError):
    """A generation request is invalid (prompt too long, bad sampling parameter...)."""
