"""Path settings: what each command's path keys may name, parsed and checked in one place.

A config key that holds a path is declared `knob(..., path=KIND)`; `common.config` parses every such
value when a config is loaded (`parse_problem`: no request, no file touched) and checks it when a
command line is read (`check_problem`: before the command does any work). The kinds:

    dir_out   a local directory the command writes (a run directory, a build, an export)
    file_out  a local file the command writes
    local_in  a local file or directory the command reads (a target, a corpus, a config)
    data_in   a dataset read: a local path, or s3://BUCKET/PREFIX, gs://BUCKET/PREFIX
    data_out  a dataset written: the same (gs:// only with DFLASH_UNLOCKED_WRITES=1)

Parsing refuses a value that is a TOML table or array (`out_dir={a=1}` is not a folder name), an
object-store URI where the kind takes a local path (checkpoints and builds are renamed into place;
docs/object-storage.md lists what may live on a store), a scheme not served here (`hdfs://`) and a
URI without a bucket. Checking adds, for a store, a HEAD of the bucket with the credentials at
hand and the DFLASH_* settings (`common.objstore.check_location`); for a local output, that its
directory exists or can be created, is a directory, and can be written. Whether an input exists
is left to the command, which knows what it expected there.
"""

from __future__ import annotations

import os
import tomllib

from common import objstore
from common.local_dirs import writable_dir_problem

KINDS = ("dir_out", "file_out", "local_in", "data_in", "data_out")
STORE_KINDS = ("data_in", "data_out")
_LOCAL_ONLY = {
    "dir_out": "this setting takes a local directory (what is written there is renamed into place, which an object "
    "store cannot do; write locally and copy it up)",
    "file_out": "this setting takes a local file",
    "local_in": "this setting is read from a local disk (copy it down first)",
}


def is_uri(text: str) -> bool:
    """A URI (`scheme://...`), as `common.io.resolve` tells one from a local path."""
    return "://" in text


def parse_problem(text: str, kind: str) -> str | None:
    """What is wrong with the path setting `text` of `kind` on its face (None: nothing)."""
    assert kind in KINDS, kind
    spelled = _toml_container(text)
    if spelled:
        return f"{text!r} is a TOML {spelled}, not a path"
    if not is_uri(text):
        scheme, one_slash, _ = text.partition(":/")
        if one_slash and scheme.lower() in objstore.STORE_SCHEMES:
            return f"{text!r} looks like a {scheme}:// URI with one slash (a path joined by a tool?); write {scheme}://"
        return None
    if kind not in STORE_KINDS:
        return f"{text!r} is an object-store URI, but {_LOCAL_ONLY[kind]}; see docs/object-storage.md"
    problem = objstore.uri_problem(text)
    return None if problem is None else f"{text!r}: {problem}"


def check_problem(text: str, kind: str) -> str | None:
    """`parse_problem`, then what a look at the location finds (None: it can be used)."""
    problem = parse_problem(text, kind)
    if problem is not None:
        return problem
    if is_uri(text):
        try:
            objstore.check_location(text, write=kind == "data_out")
        except objstore.StoreSetupError as err:
            return str(err)
        return None
    if kind in ("dir_out", "data_out"):
        return writable_dir_problem(os.path.abspath(text))
    if kind == "file_out":
        return writable_dir_problem(os.path.dirname(os.path.abspath(text)))
    return None


def _toml_container(text: str) -> str | None:
    """ "table" or "array" if `text` is one as TOML reads it (`{a=1}`, `[1, 2]`), else None."""
    if text.lstrip()[:1] not in ("{", "["):
        return None
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return None
    return "table" if isinstance(value, dict) else "array" if isinstance(value, list) else None
