"""A file system that is local underneath but not `file://` to fsspec: `remotelike:///abs/path`.

Put on PYTHONPATH of a `cputrain train` process (Python imports sitecustomize at start), it
makes every rank take the code path of a remote run folder (s3://, gs://): checkpoints through
DCP's fsspec writer and reader, renames through fsspec, the export staged and uploaded.
Each file opened for writing through it is appended to $REMOTELIKE_WRITE_LOG, so a test can
tell a file written through fsspec from one written to the local disk behind its back.
"""

import os

import fsspec
from fsspec.implementations.local import LocalFileSystem

PROTOCOL = "remotelike"


class RemoteLikeFileSystem(LocalFileSystem):
    protocol = (PROTOCOL,)

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        if path.startswith(f"{PROTOCOL}://"):
            path = path[len(f"{PROTOCOL}://"):]
        return super()._strip_protocol(path)

    def unstrip_protocol(self, name):
        return f"{PROTOCOL}://{self._strip_protocol(name)}"

    def _open(self, path, mode="rb", *args, **kwargs):
        log = os.environ.get("REMOTELIKE_WRITE_LOG")
        if log and any(c in mode for c in "wa"):
            with open(log, "a") as f:  # O_APPEND: lines of several ranks do not interleave
                f.write(f"{self._strip_protocol(path)}\n")
        return super()._open(path, mode, *args, **kwargs)


fsspec.register_implementation(PROTOCOL, RemoteLikeFileSystem, clobber=True)
