"""Errors the user can fix. The CLI prints them as one line and exits non-zero (traceback only
with --debug); anything else is a bug and keeps its traceback."""


class UserError(Exception):
    """Bad input: the message says what is wrong and how to fix it."""

    exit_code = 2
    label = "cputrain: error: "  # how the command line introduces the message


class ConfigError(UserError):
    """A config file, key or value that cannot be used."""


class DataError(UserError):
    """A dataset that is missing, empty or has no usable text."""


class ModelError(UserError):
    """A model folder, weights file or tokenizer that cannot be used."""


class RunFolderError(UserError):
    """An output_dir that would be damaged by this run."""


class Diverged(UserError):
    """The loss or gradient norm stayed non-finite for train.max_bad_steps steps in a row."""

    exit_code = 3


class Stopped(UserError):
    """Stopped by a signal at a step boundary, with a checkpoint saved: not a failure. The exit code
    is sysexits.h EX_TEMPFAIL ("a temporary failure; retry"): not 0 (a Kubernetes Job would count the
    pod as done), not 1/2/3 (failures), not 143 (killed without a checkpoint)."""

    exit_code = 75
    label = "cputrain: "


def one_line(exc: BaseException) -> str:
    """A library's whole message on one line. Validators (transformers' strict configs among
    them) put the field on the first line and the reason on the next; the first line alone
    ends mid-sentence ("Validation error for field 'x':")."""
    text = " ".join(line.strip() for line in str(exc).strip().splitlines() if line.strip())
    return text or type(exc).__name__


def first_line(exc: BaseException) -> str:
    """A library's message cut to its first line (its type's name when it has none)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class PeerLost(UserError):
    """This rank's collective failed because another rank is gone (killed, out of memory, its node
    lost). Not this rank's fault: under the agent, its line names the rank that failed first."""

    exit_code = 1
    label = "cputrain: "
