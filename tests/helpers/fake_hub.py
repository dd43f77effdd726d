"""A local stand-in for the Hugging Face Hub: repos served from local folders, over HTTP on 127.0.0.1, the way the Hub
answers huggingface_hub 2.4's download path (`snapshot_download`, `hf_hub_download`, `HfApi.model_info`), so that
tests run the Hub's own client, pointed here with HF_ENDPOINT, and nothing reaches the internet.

    GET       /api/models/ORG/NAME[/revision/REV]   model_info / repo_info: id, sha (the commit), siblings
    GET       /api/models/ORG/NAME/tree/REV[/DIR]   list_repo_tree: `page_size` entries a page, the next page's url
                                                    in a Link header (rel="next"), as the Hub paginates
    HEAD|GET  /ORG/NAME/resolve/REV/FILE            a git file: 200, ETag (its git blob id), X-Repo-Commit;
                                                    an LFS file: 302 to the CDN, X-Linked-Etag (its sha256),
                                                    X-Linked-Size, X-Repo-Commit
    GET       /cdn/SHA256 (host "localhost")        an LFS file's bytes

NOTE: the CDN is the same server under another host name (localhost, the API being 127.0.0.1): huggingface_hub
follows a redirect only within the Hub's host, so the metadata of an LFS file is read from the 302 itself (X-Linked-*),
and the download goes to the CDN without the token, as with the real Hub.

Failures carry the X-Error-Code that `hf_raise_for_status` reads: RepoNotFound (404; 401 for a private repo asked
without its token), RevisionNotFound (404), EntryNotFound (404), GatedRepo (a file of a gated repo: 401 without a
token, 403 with one not granted; its listing and info stay public, as on the Hub).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

# What the Hub stores in LFS (by .gitattributes); everything else is a plain git file.
LFS_SUFFIXES = (".safetensors", ".bin", ".msgpack", ".h5", ".gguf", ".pt", ".pth", ".onnx")


@dataclass(frozen=True)
class Repo:
    """A model repo: its branches, each a local folder of files (subfolders too), and who may read it."""

    branches: dict[str, Path]
    gated: bool = False  # files need `token` (401 without a token, 403 with another)
    private: bool = False  # everything needs `token` (401 RepoNotFound otherwise, as for a missing repo)
    token: str | None = None


@dataclass
class _File:
    path: str
    data: bytes
    git_oid: str = field(init=False)  # git's blob id: the ETag of a plain file
    sha256: str = field(init=False)  # the LFS id: the ETag of an LFS file, and its name on the CDN

    def __post_init__(self) -> None:
        self.git_oid = hashlib.sha1(b"blob %d\0" % len(self.data) + self.data).hexdigest()
        self.sha256 = hashlib.sha256(self.data).hexdigest()

    @property
    def lfs(self) -> bool:
        return self.path.endswith(LFS_SUFFIXES)


@dataclass
class _Commit:
    sha: str
    files: dict[str, _File]


def _commit(repo_id: str, branch: str, folder: Path) -> _Commit:
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        name = path.relative_to(folder).as_posix()
        files[name] = _File(name, path.read_bytes())
    digest = hashlib.sha1(f"{repo_id}@{branch}".encode())
    for f in files.values():
        digest.update(f"{f.path}:{f.git_oid}".encode())
    return _Commit(digest.hexdigest(), files)


class FakeHub:
    """`with FakeHub({"org/name": Repo({"main": folder})}) as hub:` serves the repos at `hub.endpoint` (files are read
    once, at start); `hub.requests` lists (method, path) of every request, in order; while `hub.outage` is a status,
    every request is answered with it."""

    def __init__(self, repos: dict[str, Repo], page_size: int = 3) -> None:
        self.repos = repos
        self.page_size = page_size
        self.requests: list[tuple[str, str]] = []
        self.outage: int | None = None  # a status (503) every request gets while set: the Hub down
        # repo -> revision (a branch name or a commit sha) -> commit
        self.commits: dict[str, dict[str, _Commit]] = {}
        for repo_id, repo in repos.items():
            self.commits[repo_id] = {}
            for branch, folder in repo.branches.items():
                commit = _commit(repo_id, branch, folder)
                self.commits[repo_id][branch] = self.commits[repo_id][commit.sha] = commit
        self.blobs = {f.sha256: f for revs in self.commits.values() for c in revs.values() for f in c.files.values()}
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._server.shutdown()
        self._server.server_close()

    def commit_sha(self, repo_id: str, revision: str = "main") -> str:
        return self.commits[repo_id][revision].sha

    def client_env(self, hf_home: Path, token: str | None = None, offline: bool = False) -> dict[str, str]:
        """The environment of a process whose huggingface_hub is a client of this hub, caching under `hf_home`: the
        caller's, less its Hugging Face settings (a user's token, cache or endpoint is never read)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE_", "TRANSFORMERS_"))}
        env |= {
            "HF_ENDPOINT": self.endpoint,
            "HF_HOME": str(hf_home),  # (its token file too)
            "HF_HUB_CACHE": str(hf_home / "hub"),
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_OFFLINE": "1" if offline else "0",
            "NO_PROXY": "127.0.0.1,localhost",
        }
        if token is not None:
            env["HF_TOKEN"] = token
        return env


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as httpx2's pool expects of the Hub

        def log_message(self, format, *args) -> None:  # noqa: A002 (the base class's name)
            pass

        def do_GET(self) -> None:
            self._route(body=True)

        def do_HEAD(self) -> None:
            self._route(body=False)

        def _route(self, body: bool) -> None:
            url = urlsplit(self.path)
            hub.requests.append((self.command, url.path))
            if hub.outage is not None:
                return self._send(hub.outage, {}, b"Service Unavailable", body)
            # split before unquoting: a revision ("refs%2Fpr%2F1") or a file name may hold an escaped '/'
            parts = [unquote(p) for p in url.path.strip("/").split("/")]
            if parts[0] == "cdn" and len(parts) == 2 and parts[1] in hub.blobs:
                return self._send(200, {"ETag": f'"{parts[1]}"'}, hub.blobs[parts[1]].data, body)
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                return self._api("/".join(parts[2:4]), parts[4:], parse_qs(url.query), body)
            if len(parts) >= 5 and parts[2] == "resolve":
                return self._resolve("/".join(parts[:2]), parts[3], "/".join(parts[4:]), body)
            self._send(404, {}, b"Not Found", body)

        def _api(self, repo_id: str, rest: list[str], query: dict[str, list[str]], body: bool) -> None:
            if not self._repo_visible(repo_id, body):
                return
            revision = rest[1] if rest[:1] in (["revision"], ["tree"]) and len(rest) >= 2 else "main"
            commit = self._commit(repo_id, revision, body)
            if commit is None:
                return
            if not rest or rest[0] == "revision":
                repo = hub.repos[repo_id]
                info = {
                    "id": repo_id,
                    "modelId": repo_id,
                    "sha": commit.sha,
                    "private": repo.private,
                    "gated": "manual" if repo.gated else False,
                    "disabled": False,
                    "siblings": [{"rfilename": name} for name in commit.files],
                }
                return self._send_json(info, {}, body)
            if rest[0] == "tree":
                return self._tree(repo_id, revision, commit, "/".join(rest[2:]), query, body)
            self._send(404, {}, b"Not Found", body)

        def _tree(self, repo_id: str, revision: str, commit: _Commit, folder: str, query: dict, body: bool) -> None:
            recursive = query.get("recursive", ["False"])[0].lower() == "true"
            prefix = f"{folder}/" if folder else ""
            entries, folders = [], set()
            for f in commit.files.values():
                if not f.path.startswith(prefix):
                    continue
                parts = f.path[len(prefix) :].split("/")
                # the folders on the way to the file, each listed once (only the first level unless recursive)
                for depth in range(1, len(parts) if recursive else min(len(parts), 2)):
                    if (sub := prefix + "/".join(parts[:depth])) not in folders:
                        folders.add(sub)
                        entries.append(
                            {"type": "directory", "oid": hashlib.sha1(sub.encode()).hexdigest(), "path": sub}
                        )
                if recursive or len(parts) == 1:
                    entry = {"type": "file", "oid": f.git_oid, "size": len(f.data), "path": f.path}
                    if f.lfs:
                        entry["lfs"] = {"oid": f.sha256, "size": len(f.data), "pointerSize": 134}
                    entries.append(entry)
            cursor = int(query.get("cursor", ["0"])[0])
            page = entries[cursor : cursor + hub.page_size]
            headers = {}
            if cursor + hub.page_size < len(entries):
                tree = f"{hub.endpoint}/api/models/{repo_id}/tree/{quote(revision, safe='')}"
                tree += f"/{quote(folder, safe='')}" if folder else ""
                headers["Link"] = f'<{tree}?recursive={recursive}&cursor={cursor + hub.page_size}>; rel="next"'
            self._send_json(page, headers, body)

        def _resolve(self, repo_id: str, revision: str, path: str, body: bool) -> None:
            if not self._repo_visible(repo_id, body):
                return
            repo = hub.repos[repo_id]
            if repo.gated and not self._authorized(repo):
                status = 403 if self.headers.get("authorization") else 401
                message = f"Access to model {repo_id} is restricted. You must have access to it and be authenticated."
                return self._error(status, "GatedRepo", message, body)
            commit = self._commit(repo_id, revision, body)
            if commit is None:
                return
            f = commit.files.get(path)
            if f is None:
                return self._error(404, "EntryNotFound", f"{path} does not exist", body, {"X-Repo-Commit": commit.sha})
            if f.lfs:
                headers = {
                    "Location": f"http://localhost:{hub.port}/cdn/{f.sha256}",
                    "X-Linked-Etag": f'"{f.sha256}"',
                    "X-Linked-Size": str(len(f.data)),
                    "X-Repo-Commit": commit.sha,
                    "ETag": f'"{f.git_oid}"',  # (the pointer file's: X-Linked-Etag is the one that counts)
                }
                return self._send(302, headers, b"", body)
            self._send(200, {"ETag": f'"{f.git_oid}"', "X-Repo-Commit": commit.sha}, f.data, body)

        def _authorized(self, repo: Repo) -> bool:
            return self.headers.get("authorization") == f"Bearer {repo.token}"

        def _repo_visible(self, repo_id: str, body: bool) -> bool:
            repo = hub.repos.get(repo_id)
            if repo is None or (repo.private and not self._authorized(repo)):
                status = 401 if repo is not None else 404
                self._error(status, "RepoNotFound", "Repository not found", body)
                return False
            return True

        def _commit(self, repo_id: str, revision: str, body: bool) -> _Commit | None:
            commit = hub.commits[repo_id].get(revision)
            if commit is None:
                self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}", body)
            return commit

        def _error(self, status: int, code: str, message: str, body: bool, headers: dict | None = None) -> None:
            headers = {**(headers or {}), "X-Error-Code": code, "X-Error-Message": message}
            self._send_json({"error": message}, headers, body, status)

        def _send_json(self, value, headers: dict[str, str], body: bool, status: int = 200) -> None:
            self._send(status, {"Content-Type": "application/json", **headers}, json.dumps(value).encode(), body)

        def _send(self, status: int, headers: dict[str, str], data: bytes, body: bool) -> None:
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

    return Handler
