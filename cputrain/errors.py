"""Errors the user can fix. The CLI prints them as one line and exits non-zero (traceback only
with --debug); anything else is a bug and keeps its traceback."""


class UserError(Exception):
    """Bad input: the message says what is wrong and how to fix it."""

    exit_code = 2


class ConfigError(UserError):
    """A config file, key or value that cannot be used."""


class DataError(UserError):
    """A dataset that is missing, empty or has no usable text."""


class ModelError(UserError):
    """A model folder, weights file or tokenizer that cannot be used."""


class RunFolderError(UserError):
    """An output_dir that would be damaged by this run."""
