"""Distributed checkpoints read without running code a file can craft.

`torch.distributed.checkpoint` (DCP) keeps the tensors of `state/` in its own binary files, but two of its reads
unpickle: the `state/.metadata` index (`pickle.load`) and each non-tensor entry, such as an optimizer's
`param_groups` (`torch.load(weights_only=False)`). A checkpoint copied from elsewhere, or edited in place (the CRCs
in its COMPLETE are recomputed as easily), could then run any code on resume. Here the index is read by a
restricted unpickler (the pickle module's documented "restricting globals" pattern) that resolves only the DCP
metadata types, `torch.Size`, torch's dtypes and layouts and `pathlib` paths, and every non-tensor entry through
torch's own safe loader (`weights_only=True`). The files DCP writes are unchanged, so checkpoints stay readable
by DCP itself and by older versions.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_METADATA_TYPES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                                              "MetadataIndex", "StorageMeta", "TensorProperties",
                                              "TensorStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # torch.layout pickles as _get_layout("torch.strided")
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class UnsafeCheckpointError(ValueError):
    """A checkpoint's metadata names something a checkpoint never holds (it could run code): not loaded."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_TYPES.get(module, ()) or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(f"its metadata names {module}.{name}, which no checkpoint holds (it could run "
                                    "code): not loaded")


def read_metadata(path: str | Path) -> Metadata:
    """A DCP metadata file, through the restricted unpickler."""
    with open(path, "rb") as f:
        try:
            metadata = _MetadataUnpickler(f).load()
        except UnsafeCheckpointError:
            raise
        except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as e:
            raise UnsafeCheckpointError(f"its metadata cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"its metadata is a {type(metadata).__name__}, not DCP metadata: not loaded")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """`FileSystemReader` whose metadata read resolves only the metadata types."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        metadata = read_metadata(Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata"))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """`DefaultLoadPlanner` whose non-tensor entries load through `torch.load(weights_only=True)`."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpointError(f"its entry {read_item.dest_index.fqn} is not plain data ({e})") from None
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def load(state_dict: dict[str, Any], path: str | Path) -> None:
    """`dcp.load` into ``state_dict`` (in place), unpickling nothing a file can craft. The metadata is read once
    first, so a crafted one is refused in one line (`UnsafeCheckpointError`), not inside DCP's wrapped errors."""
    if (Path(path) / ".metadata").is_file():
        read_metadata(Path(path) / ".metadata")
    dcp.load(state_dict, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner())


__all__ = ["SafeFileSystemReader", "SafeLoadPlanner", "UnsafeCheckpointError", "load", "read_metadata"]
