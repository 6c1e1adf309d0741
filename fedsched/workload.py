"""What a job runs: the :class:`Workload` section of a job spec, and each gang member's environment.

A workload is what a real backend (Kubernetes, Slurm) starts for every worker of an attempt: an
OCI container image, an argv (``command`` then ``args``, never passed through a shell), plain
environment variables, secret references *by name* (``secret_env``: ``ENV_NAME ->
"secret-name/key"``; the backend resolves them from its own secret store when it starts the
worker, so secret values never enter fedsched: not the spec, the events, the audit log or
GetJob), a working directory and an optional checkpoint location. The ``trace`` backend accepts a
workload and ignores it. Trace jobs have none (``JobSpec.workload is None``).

Per-worker environment (:func:`worker_env`): the variables PyTorch's ``torchrun`` sets and
``torch.distributed``'s ``env://`` rendezvous reads (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) plus fedsched's own ``FEDSCHED_*``.
User environment may not set any of them, nor the rank variables backends and MPI launchers set
(``SLURM_PROCID``, ``JOB_COMPLETION_INDEX``, ``OMPI_COMM_WORLD_RANK``, ``PMI_RANK`` ...):
:data:`RESERVED_ENV`, :data:`RESERVED_ENV_PREFIX`.

Limits (bytes are UTF-8 bytes): :class:`WorkloadLimits`. Every violation raises
:class:`~fedsched.errors.ValidationError` whose ``field`` is the path inside the job spec
(``workload.image``, ``workload.args[3]``, ``workload.env[RANK]``, ``workload.env`` for a
malformed name or too many variables, ``workload`` for the whole size); admission prefixes
``spec.``.
"""

from __future__ import annotations

import re
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fedsched.errors import ValidationError


class WorkloadLimits:
    """Size caps of a workload (a plain namespace; admission's ``Limits`` documents the same).

    Attributes:
        max_image_chars: longest image reference (characters).
        max_argv: most items in ``command`` + ``args`` together.
        max_arg_bytes: longest single command/args item (UTF-8 bytes).
        max_env: most variables in ``env`` + ``secret_env`` together.
        max_env_value_bytes: longest ``env`` value (UTF-8 bytes).
        max_path_chars: longest ``workdir`` / ``checkpoint_uri``.
        max_total_bytes: the whole workload: every string of it summed (UTF-8 bytes).
    """

    max_image_chars = 512
    max_argv = 256
    max_arg_bytes = 4096
    max_env = 128
    max_env_value_bytes = 32 * 1024
    max_path_chars = 4096
    max_total_bytes = 64 * 1024


#: Variables :func:`worker_env` sets or a backend/launcher sets per rank; user env may not set them.
RESERVED_ENV = frozenset({
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
    "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "JOB_COMPLETION_INDEX",
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE",
})
#: Every name with this prefix is fedsched's (:func:`worker_env`).
RESERVED_ENV_PREFIX = "FEDSCHED_"

# POSIX.1-2017 8.1: portable environment names are upper/lower letters, digits and '_', not
# starting with a digit.
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*", re.ASCII)

# OCI/Docker image references, after distribution/reference's grammar (reference.go):
#   reference := name [":" tag] ["@" digest];  name := [domain "/"] path-component ("/" path-component)*
_ALNUM = r"[a-z0-9]+"
_SEP = r"(?:[._]|__|-+)"
_PATH_COMPONENT = rf"{_ALNUM}(?:{_SEP}{_ALNUM})*"
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*(?::[0-9]+)?"
_NAME = rf"(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
_TAG = r"[\w][\w.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
_IMAGE = re.compile(rf"(?P<name>{_NAME})(?::{_TAG})?(?:@{_DIGEST})?", re.ASCII)
_MAX_IMAGE_NAME = 255  # distribution/reference NameTotalLengthMax

# Secret reference "secret-name/key": the name a Kubernetes Secret may have (RFC 1123 subdomain,
# <= 253) and a key a Secret's data may have ([-._a-zA-Z0-9]+, <= 253). Slurm backends map the
# pair onto their own store. Anything else (spaces, '=', a bare value) is refused.
_SECRET_NAME = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?(?:\.[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)*"
_SECRET_REF = re.compile(rf"(?P<name>{_SECRET_NAME})/(?P<key>[-._a-zA-Z0-9]+)", re.ASCII)

# A URI with a scheme and an authority/path (s3://bucket/run1, gs://..., file:///ckpt, pvc://claim/dir).
_URI = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s\x00-\x1f\x7f]+", re.ASCII)


def _nbytes(s: str) -> int:
    return len(s.encode("utf-8", "surrogatepass"))


def _shown(s: str) -> str:
    return repr(s if len(s) <= 40 else s[:37] + "...")


def _check_env_name(name: str, field: str) -> None:
    if not _ENV_NAME.fullmatch(name) or len(name) > 256:
        raise ValidationError(field, f"{_shown(name)} is not an environment variable name (POSIX: letters, digits "
                                     f"and '_', not starting with a digit, at most 256 characters)")
    if name in RESERVED_ENV or name.startswith(RESERVED_ENV_PREFIX):
        raise ValidationError(f"{field}[{name}]", f"{name} is set by fedsched or the backend for each worker "
                                                  f"(rank and FEDSCHED_* variables); a workload may not set it")


class Workload(BaseModel):
    """What each worker of a job runs (immutable; validated on construction).

    Attributes:
        image: OCI image reference (``registry:5000/team/trainer:1.4@sha256:...``), <= 512 characters.
        command: the argv to run, no shell (Kubernetes ``command``); empty = the image's entrypoint.
        args: arguments after ``command`` (Kubernetes ``args``); ``command`` + ``args`` <= 256 items,
            each <= 4096 bytes.
        env: plain environment variables (POSIX names, values <= 32 KiB).
        secret_env: ``ENV_NAME -> "secret-name/key"``: references only, the backend resolves the value;
            ``env`` + ``secret_env`` <= 128 names, no name in both.
        workdir: absolute working directory, "" = the image's.
        checkpoint_uri: where a checkpointable job writes and resumes from (``s3://bucket/run``), ""
            = none; given to the backend and to the workers as ``FEDSCHED_CHECKPOINT_URI``.

    Raises:
        ValidationError: the first rule broken, ``field`` = ``workload.<path>`` (module docstring).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    image: str
    command: tuple[str, ...] = ()
    args: tuple[str, ...] = ()
    env: dict[str, str] = Field(default_factory=dict)
    secret_env: dict[str, str] = Field(default_factory=dict)
    workdir: str = ""
    checkpoint_uri: str = ""

    @model_validator(mode="after")
    def _valid(self) -> "Workload":
        lim = WorkloadLimits
        if not self.image:
            raise ValidationError("workload.image", "required: the OCI image reference to run")
        if len(self.image) > lim.max_image_chars:
            raise ValidationError("workload.image", f"at most {lim.max_image_chars} characters")
        m = _IMAGE.fullmatch(self.image)
        if m is None or len(m.group("name")) > _MAX_IMAGE_NAME:
            raise ValidationError("workload.image", f"{_shown(self.image)} is not an OCI image reference "
                                                    "([registry[:port]/]path[:tag][@algo:digest], lowercase path)")
        if len(self.command) + len(self.args) > lim.max_argv:
            raise ValidationError("workload.args", f"command and args together at most {lim.max_argv} items")
        for name, items in (("command", self.command), ("args", self.args)):
            for i, item in enumerate(items):
                if _nbytes(item) > lim.max_arg_bytes or "\x00" in item:
                    raise ValidationError(f"workload.{name}[{i}]", f"at most {lim.max_arg_bytes} bytes, no NUL")
        if len(self.env) + len(self.secret_env) > lim.max_env:
            raise ValidationError("workload.env", f"env and secret_env together at most {lim.max_env} variables")
        for name, value in self.env.items():
            _check_env_name(name, "workload.env")
            if _nbytes(value) > lim.max_env_value_bytes or "\x00" in value:
                raise ValidationError(f"workload.env[{name}]", f"value at most {lim.max_env_value_bytes} bytes, no NUL")
        for name, ref in self.secret_env.items():
            _check_env_name(name, "workload.secret_env")
            if name in self.env:
                raise ValidationError(f"workload.secret_env[{name}]", "also set in env; give a variable one source")
            m = _SECRET_REF.fullmatch(ref)
            if m is None or len(m.group("name")) > 253 or len(m.group("key")) > 253:
                raise ValidationError(f"workload.secret_env[{name}]",
                                      "must be a reference 'secret-name/key' (secret name: lowercase RFC 1123, "
                                      "key: letters, digits, '-', '.', '_'), never a secret's value")
        if self.workdir and (not self.workdir.startswith("/") or len(self.workdir) > lim.max_path_chars
                             or "\x00" in self.workdir):
            raise ValidationError("workload.workdir", f"an absolute path of at most {lim.max_path_chars} characters")
        if self.checkpoint_uri and (len(self.checkpoint_uri) > lim.max_path_chars
                                    or not _URI.fullmatch(self.checkpoint_uri)):
            raise ValidationError("workload.checkpoint_uri", "a URI with a scheme (s3://bucket/path, file:///dir), "
                                                             f"at most {lim.max_path_chars} characters, no spaces")
        total = (_nbytes(self.image) + sum(map(_nbytes, self.command)) + sum(map(_nbytes, self.args))
                 + sum(_nbytes(k) + _nbytes(v) for d in (self.env, self.secret_env) for k, v in d.items())
                 + _nbytes(self.workdir) + _nbytes(self.checkpoint_uri))
        if total > lim.max_total_bytes:
            raise ValidationError("workload", f"{total} bytes; the whole workload at most {lim.max_total_bytes} bytes")
        return self

    @property
    def argv(self) -> tuple[str, ...]:
        """``command + args`` (what an exec without a shell runs; empty = the image's entrypoint)."""
        return self.command + self.args


class GangSpec(Protocol):
    """What :func:`worker_env` reads of a job spec (:class:`fedsched.jobs.JobSpec` is one; a
    protocol so that this module and ``fedsched.jobs``, which imports :class:`Workload`, do not
    import each other)."""

    @property
    def workers(self) -> int: ...
    @property
    def shards(self) -> int: ...
    @property
    def workload(self) -> "Workload | None": ...


def worker_env(spec: GangSpec, *, job_id: str, attempt: int, rank: int, master_addr: str, master_port: int,
               world_size: int | None = None, shard: int = 0) -> dict[str, str]:
    """The environment of gang member ``rank`` of one attempt: the workload's plain ``env`` with
    fedsched's per-worker variables on top (pure; secret references are not in it -- the backend
    resolves ``secret_env`` from its secret store).

    Variables (all strings):

    ============================ ==========================================================
    ``RANK``                     this worker's rank in the gang, ``0..WORLD_SIZE-1``
    ``WORLD_SIZE``               gang size (``spec.workers``; a gang never runs partially)
    ``LOCAL_RANK``               ``0``: one worker per container, which sees only its GPUs
    ``LOCAL_WORLD_SIZE``         ``1`` (same reason)
    ``GROUP_RANK``               ``RANK`` (torchrun's node rank; one worker per container)
    ``MASTER_ADDR``              host of rank 0, where ``env://`` rendezvous meets
    ``MASTER_PORT``              its port (1..65535)
    ``FEDSCHED_JOB_ID``          the job id
    ``FEDSCHED_ATTEMPT``         the attempt number (1 = first); fences a stale copy
    ``FEDSCHED_SHARD``           shard index of a split batch job (0 otherwise)
    ``FEDSCHED_CHECKPOINT_URI``  ``workload.checkpoint_uri``, only when one is set
    ============================ ==========================================================

    These are what ``torch.distributed.init_process_group(init_method="env://")`` and scripts
    written for ``torchrun`` read. Backends also have their native forms, which a backend may set
    alongside and which mean the same: Slurm ``SLURM_PROCID`` = ``RANK``, ``SLURM_NTASKS`` =
    ``WORLD_SIZE``, ``SLURM_LOCALID`` = ``LOCAL_RANK``; a Kubernetes indexed Job's
    ``JOB_COMPLETION_INDEX`` = ``RANK``; an MPI launcher's ``OMPI_COMM_WORLD_RANK`` / ``PMI_RANK``
    = ``RANK``. A workload's ``env`` may set none of these (:data:`RESERVED_ENV`, anything
    ``FEDSCHED_*``), so the values here always win.

    Args:
        spec: the job (its ``workload`` may be None: a trace job, the user env is then empty).
        job_id: the job's id.
        attempt: attempt number, >= 1.
        rank: this worker, ``0 <= rank < world_size``.
        master_addr: rank 0's address (host name or IP), non-empty.
        master_port: rank 0's rendezvous port, 1..65535.
        world_size: gang size; None = ``spec.workers``; any other value is refused.
        shard: shard index, ``0 <= shard < spec.shards``.

    Raises:
        ValueError: an argument out of the ranges above.
    """
    size = spec.workers if world_size is None else world_size
    if size != spec.workers:
        raise ValueError(f"world_size {size} != the gang's {spec.workers} workers: a gang never runs partially")
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} outside 0..{size - 1}")
    if attempt < 1:
        raise ValueError(f"attempt {attempt} < 1")
    if not 0 <= shard < spec.shards:
        raise ValueError(f"shard {shard} outside 0..{spec.shards - 1}")
    if not master_addr:
        raise ValueError("master_addr is empty")
    if not 1 <= master_port <= 65535:
        raise ValueError(f"master_port {master_port} outside 1..65535")
    env = dict(spec.workload.env) if spec.workload is not None else {}
    env.update({
        "RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
        "GROUP_RANK": str(rank), "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
        "FEDSCHED_JOB_ID": job_id, "FEDSCHED_ATTEMPT": str(attempt), "FEDSCHED_SHARD": str(shard),
    })
    if spec.workload is not None and spec.workload.checkpoint_uri:
        env["FEDSCHED_CHECKPOINT_URI"] = spec.workload.checkpoint_uri
    return env
