"""``modeld pull``: a model from a Hugging Face repository (or a local path) into the store, checked.

The repository's listing comes from ``huggingface_hub`` (``HfApi.model_info`` with the files'
metadata: sizes, the LFS sha256 of each large file, the git blob id of each small one), so
``HF_TOKEN``, ``HF_ENDPOINT`` (a mirror) and the proxy settings are the library's. The files
come over plain HTTP(S) from the repository's ``resolve`` URLs through the library's session,
into ``.downloads/`` in the store under their content hash:

* a transfer cut off is resumed where it stopped (``Range``), a few times within one pull, and
  by the next pull of the same file if this one gives up or is interrupted;
* a finished file is checked against the hash the Hub lists for it; a mismatch is refused and
  the file removed (a second download starts from nothing);
* free disk is checked for what is left to fetch before anything is fetched.

``huggingface_hub.hf_hub_download`` would do the transfer too, but its 1.x versions drop a partial
file when a download fails: an interrupted multi-GiB pull would start over.

A local file or directory is hard-linked into the store where the filesystem allows (no second
copy on disk; the store's file outlives the original's removal), else copied; a split GGUF's
other parts come with its first.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backends.formats import GGUF
from backends.registry import format_on_disk, not_a_known_format

from .refs import Choice, HubRef, RefError, choices, default_name, label, parse_ref, pick
from .store import ModelStore, StoredFile, StoredModel, StoreError, check_name

__all__ = ["PullError", "import_local", "plan_pull", "pull", "pull_hub"]

#: how many times one pull resumes a transfer the network cut before it gives up (the next pull resumes too)
RESUME_ATTEMPTS = 5
#: seconds to connect, and to wait for the next bytes; a machine without a network fails in seconds
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 60.0
#: free disk kept beyond what a pull writes
DISK_MARGIN_BYTES = 256 << 20
_CHUNK = 1 << 20

Log = Callable[[str], None]


class PullError(RuntimeError):
    """A pull that did not bring the model in: unreachable hub, unknown repository, a bad checksum, no disk."""


@dataclass(frozen=True)
class RemoteFile:
    path: str
    size: int
    sha256: str = ""  # an LFS file's
    blob_id: str = ""  # a small file's git blob id (sha1 over "blob SIZE\0" + content)


@dataclass(frozen=True)
class PullPlan:
    """What ``pull_hub`` will fetch: the repository's commit, the choice, its files with their hashes."""

    ref: HubRef
    revision: str
    choice: Choice
    files: tuple[RemoteFile, ...]
    license: str
    endpoint: str

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)


def _endpoint(endpoint: str | None) -> str:
    if endpoint:
        return endpoint.rstrip("/")
    from huggingface_hub import constants

    # read at the call, not at the library's import: a mirror set later in the process counts
    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def _hub_error(exc: Exception, what: str, endpoint: str) -> PullError:
    """The one place a foreign failure becomes a PullError, most specific first."""
    import httpx
    from huggingface_hub import errors

    if isinstance(exc, errors.GatedRepoError):
        return PullError(f"{what} is gated: accept its terms on the Hub and set HF_TOKEN ({exc})")
    if isinstance(exc, errors.RepositoryNotFoundError):
        return PullError(f"{what} was not found on {endpoint} (or it is private: set HF_TOKEN)")
    if isinstance(exc, errors.RevisionNotFoundError):
        return PullError(f"{what}: no such revision on {endpoint}")
    if isinstance(exc, errors.EntryNotFoundError):
        return PullError(f"{what}: no such file on {endpoint}")
    if isinstance(exc, errors.OfflineModeIsEnabled):
        return PullError(f"{what}: HF_HUB_OFFLINE is set; the store's models still serve (modeld ls)")
    if isinstance(exc, errors.HfHubHTTPError):
        return PullError(f"{what}: {endpoint} answered {exc}")
    if isinstance(exc, httpx.TimeoutException):
        return PullError(f"{what}: {endpoint} did not answer in time ({type(exc).__name__}); "
                         "the store's models still serve (modeld ls)")
    if isinstance(exc, httpx.TransportError):
        return PullError(f"{what}: cannot reach {endpoint} ({type(exc).__name__}: {exc}); "
                         "the store's models still serve (modeld ls)")
    return PullError(f"{what}: {type(exc).__name__}: {exc}")


def plan_pull(ref: HubRef, *, endpoint: str | None = None, token: str | None = None) -> PullPlan:
    """Ask the Hub what ``ref`` names: the commit, the files and their hashes. PullError, or RefError listing
    the repository's choices when ``ref`` names none or several."""
    import httpx
    from huggingface_hub import HfApi

    ep = _endpoint(endpoint)
    try:
        info = HfApi(endpoint=ep, token=token).model_info(
            ref.repo, revision=ref.revision or None, files_metadata=True,
            timeout=httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S))  # type: ignore[arg-type]
    except Exception as exc:  # noqa: BLE001 - translated in one place
        raise _hub_error(exc, ref.repo, ep) from exc
    remote = {}
    for s in info.siblings or []:
        lfs: Any = s.lfs
        remote[s.rfilename] = RemoteFile(s.rfilename, int(s.size or (lfs["size"] if lfs else 0)),
                                         sha256=(lfs["sha256"] if lfs else ""), blob_id=s.blob_id or "")
    chosen = pick(choices({p: f.size for p, f in remote.items()}), ref)
    card: Any = info.card_data
    lic = card.get("license", "") if card is not None else ""
    return PullPlan(ref=ref, revision=info.sha or ref.revision, choice=chosen,
                    files=tuple(remote[p] for p in chosen.files),
                    license=", ".join(lic) if isinstance(lic, list) else str(lic or ""), endpoint=ep)


def _progress(total: int, initial: int, label: str) -> Any:
    from huggingface_hub.utils.tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="B", unit_scale=True, unit_divisor=1024,  # type: ignore[no-untyped-call]
                desc=label, disable=not sys.stderr.isatty(), leave=False)


def _check_disk(where: Path, need: int) -> None:
    free = shutil.disk_usage(where).free
    if need + DISK_MARGIN_BYTES > free:
        raise PullError(f"not enough disk in {where}: the pull needs {need / 2**30:.2f} GiB more, "
                        f"{free / 2**30:.2f} GiB is free (and {DISK_MARGIN_BYTES >> 20} MiB is kept spare)")


def _content_hash(path: Path, git_blob: bool = False) -> str:
    h = hashlib.sha1() if git_blob else hashlib.sha256()
    if git_blob:
        h.update(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _fetch(url: str, part: Path, size: int, headers: dict[str, str], log: Log) -> None:
    """Bring ``url`` into ``part`` up to ``size`` bytes, resuming from what ``part`` holds."""
    import httpx
    from huggingface_hub import get_session, hf_raise_for_status

    timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
    attempt = 0
    bar = _progress(size, 0, part.name[:12])
    try:
        while True:
            have = part.stat().st_size if part.exists() else 0
            if have > size:
                part.unlink()
                have = 0
            bar.n = have
            bar.refresh()
            if have == size:
                return
            h = dict(headers)
            if have:
                h["Range"] = f"bytes={have}-"
            try:
                with get_session().stream("GET", url, headers=h, timeout=timeout, follow_redirects=True) as r:
                    if r.status_code == 416:  # the range starts past the end: what is held is wrong
                        part.unlink()
                        continue
                    hf_raise_for_status(r)
                    resumed = r.status_code == 206
                    with open(part, "ab" if resumed else "wb") as out:
                        for chunk in r.iter_bytes():  # as received: a cut keeps what came
                            out.write(chunk)
                            bar.update(len(chunk))
                got = part.stat().st_size
                if got < size:
                    raise httpx.RemoteProtocolError(f"the transfer ended at {got} of {size} bytes")
            except httpx.TransportError as exc:
                attempt += 1
                if attempt > RESUME_ATTEMPTS:
                    raise
                log(f"modeld pull: the transfer was cut ({type(exc).__name__}: {exc}); resuming at "
                    f"{part.stat().st_size if part.exists() else 0} bytes ({attempt}/{RESUME_ATTEMPTS})")
                time.sleep(min(0.2 * 2**attempt, 5.0))
    finally:
        bar.close()


def pull_hub(store: ModelStore, ref: HubRef, *, name: str = "", endpoint: str | None = None,
             token: str | None = None, replace: bool = False, log: Log = print) -> StoredModel:
    """Pull ``ref`` into ``store``; returns its manifest. PullError / RefError / StoreError say why not."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils._headers import build_hf_headers

    plan = plan_pull(ref, endpoint=endpoint, token=token)
    model_name = check_name(name or default_name(ref, plan.choice))
    store.check_free(model_name, replace=replace)  # before anything is fetched or linked
    downloads = store.downloads()
    parts = {f.path: downloads / f"{f.sha256 or f.blob_id or f.path.replace('/', '_')}.part" for f in plan.files}
    have = sum(min(p.stat().st_size, f.size) for f in plan.files if (p := parts[f.path]).exists())
    _check_disk(downloads, plan.size - have)
    log(f"modeld pull: {plan.ref.repo}@{plan.revision[:12]}: {label(plan.choice)}, {plan.size / 2**20:.1f} MiB"
        + (f" ({have / 2**20:.1f} MiB already here)" if have else ""))
    headers = build_hf_headers(token=token)
    headers["Accept-Encoding"] = "identity"  # the bytes as stored: sizes and hashes are the file's
    stored: list[StoredFile] = []
    for f in plan.files:
        part = parts[f.path]
        url = hf_hub_url(plan.ref.repo, f.path, revision=plan.revision, endpoint=plan.endpoint)
        try:
            _fetch(url, part, f.size, headers, log)
        except Exception as exc:  # noqa: BLE001 - translated in one place
            raise _hub_error(exc, f"{plan.ref.repo}/{f.path}", plan.endpoint) from exc
        digest = _content_hash(part)
        if f.sha256 and digest != f.sha256 or not f.sha256 and f.blob_id and _content_hash(part, True) != f.blob_id:
            part.unlink()
            raise PullError(f"{plan.ref.repo}/{f.path}: the downloaded file does not match the checksum the Hub "
                            f"lists for it (sha256 {digest[:16]}…, expected {(f.sha256 or f.blob_id)[:16]}…); "
                            "refused, and the file removed: pull again to download it anew")
        stored.append(StoredFile(name=f.path, size=f.size, sha256=digest))
    staged = store.staging(model_name)
    try:
        for f in plan.files:
            dest = staged / f.path
            dest.parent.mkdir(parents=True, exist_ok=True)
            parts[f.path].rename(dest)
        license_ = plan.license or _gguf_license(staged, plan.choice)
        manifest = StoredModel(name=model_name, source=str(plan.ref), repo=plan.ref.repo, revision=plan.revision,
                               format=plan.choice.kind, quant=plan.choice.quant, primary=plan.choice.primary,
                               files=stored, size=plan.size, license=license_)
        store.commit(staged, manifest, replace=replace)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return manifest


def _gguf_license(directory: Path, chosen: Choice) -> str:
    """The license a GGUF's header names (a repository's card says it for the other formats)."""
    if chosen.kind != GGUF.kind:
        return ""
    try:
        from backends.gguf_file import gguf_scalars

        return str(gguf_scalars(directory / chosen.primary).get("general.license", "") or "")
    except (ImportError, OSError, ValueError):
        return ""


def _link_or_copy(src: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dest)
    except OSError:
        shutil.copy2(src, dest)


def import_local(store: ModelStore, path: Path, *, name: str = "", replace: bool = False,
                 log: Log = print) -> StoredModel:
    """A GGUF file (a split one's parts with it) or an OpenVINO IR directory into ``store``, linked or copied."""
    path = path.resolve()
    fmt = format_on_disk(path)
    if fmt is None:
        raise PullError(f"{path} is no model an engine here reads: {not_a_known_format()}")
    try:
        chosen = fmt.local(path)
    except ValueError as exc:
        raise PullError(str(exc)) from exc
    files = [(path if path.is_dir() else path.parent) / f for f in chosen.files]
    model_name = check_name(name or default_name(path))
    store.check_free(model_name, replace=replace)  # before anything is fetched or linked
    staged = store.staging(model_name)
    try:
        stored = []
        for src in files:
            _link_or_copy(src, staged / src.name)
            stored.append(StoredFile(name=src.name, size=src.stat().st_size, sha256=_content_hash(staged / src.name)))
        manifest = StoredModel(name=model_name, source=str(path), format=chosen.kind, quant=chosen.quant,
                               primary=chosen.primary, files=stored, size=sum(f.size for f in stored),
                               license=_gguf_license(staged, chosen))
        store.commit(staged, manifest, replace=replace)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    log(f"modeld pull: {path} is in the store as {model_name} ({manifest.size / 2**20:.1f} MiB)")
    return manifest


def pull(store: ModelStore, ref: str, *, name: str = "", endpoint: str | None = None, token: str | None = None,
         replace: bool = False, log: Log = print) -> StoredModel:
    """``modeld pull REF``: a Hub reference or a local path (``modeld.store.refs``) into ``store``."""
    parsed = parse_ref(ref)
    if isinstance(parsed, Path):
        return import_local(store, parsed, name=name, replace=replace, log=log)
    return pull_hub(store, parsed, name=name, endpoint=endpoint, token=token, replace=replace, log=log)


__all__ += ["RefError", "StoreError"]
