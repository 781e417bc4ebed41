"""A Hub-compatible HTTP server for tests: the part of the Hugging Face Hub API that
huggingface_hub's create_repo, upload_folder (regular + LFS basic transfer) and hf_hub_download
use, with tokens, private repositories and commits. Real HTTP on 127.0.0.1, in a thread."""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

LFS_THRESHOLD = 64 * 1024  # larger files (and every .safetensors) go through LFS


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    owner: str
    private: bool
    branches: dict[str, str] = field(default_factory=dict)  # branch -> commit oid
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # oid -> {path: content}


class HubState:
    def __init__(self, tokens: dict[str, str]):
        self.tokens = tokens  # token -> user name
        self.repos: dict[str, Repo] = {}
        self.lfs: dict[str, bytes] = {}  # sha256 -> content
        self.lfs_puts: list[str] = []  # sha256 of every LFS upload received
        self.commit_payloads: list[list[dict]] = []
        self.stop_on_lfs_put = False
        self.fail_next_commits = 0  # answer this many commit calls with 503 first
        self.lock = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "HubServer"

    def log_message(self, *args):  # quiet
        pass

    # -- helpers -------------------------------------------------------------------------
    @property
    def state(self) -> HubState:
        return self.server.state

    def user(self) -> str | None:
        auth = self.headers.get("Authorization", "")
        return self.state.tokens.get(auth[7:]) if auth.startswith("Bearer ") else None

    def body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().strip(), 16)
                if size == 0:
                    self.rfile.readline()
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(chunks)
        return self.rfile.read(length)

    def reply(self, status: int, obj=None, headers: dict | None = None, raw: bytes | None = None, head=False):
        data = raw if raw is not None else (json.dumps(obj).encode() if obj is not None else b"")
        self.send_response(status)
        self.send_header("Content-Type", "application/json" if raw is None else "application/octet-stream")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if not head:
            self.wfile.write(data)

    def error(self, status: int, code: str, message: str, head=False):
        self.reply(status, {"error": message}, {"X-Error-Code": code, "X-Error-Message": message}, head=head)

    def base(self) -> str:
        return f"http://{self.server.server_address[0]}:{self.server.server_address[1]}"

    def repo_for_read(self, repo_id: str, head=False) -> Repo | None:
        repo = self.state.repos.get(repo_id)
        if repo is None or (repo.private and self.user() != repo.owner):
            self.error(404 if self.user() else 401, "RepoNotFound", f"Repository {repo_id} not found", head=head)
            return None
        return repo

    def repo_for_write(self, repo_id: str) -> Repo | None:
        user = self.user()
        if user is None:
            self.error(401, "InvalidCredentials", "Invalid credentials in Authorization header")
            return None
        repo = self.state.repos.get(repo_id)
        if repo is None:
            self.error(404, "RepoNotFound", f"Repository {repo_id} not found")
            return None
        if repo.owner != user:
            self.error(403, "Forbidden", "You don't have the rights to write to this repository")
            return None
        return repo

    # -- routes --------------------------------------------------------------------------
    def do_POST(self):
        path = unquote(urlparse(self.path).path)
        body = self.body()
        parts = path.strip("/").split("/")
        if path == "/api/repos/create":
            return self.create_repo(json.loads(body))
        if path == "/api/validate-yaml":
            return self.reply(200, {"errors": [], "warnings": []})
        if len(parts) >= 6 and parts[:2] == ["api", "models"] and parts[4] == "preupload":
            return self.preupload(f"{parts[2]}/{parts[3]}", json.loads(body))
        if len(parts) >= 6 and parts[:2] == ["api", "models"] and parts[4] == "commit":
            return self.commit(f"{parts[2]}/{parts[3]}", "/".join(parts[5:]), body)
        if len(parts) >= 6 and parts[:2] == ["api", "models"] and parts[4] == "branch":
            return self.create_branch(f"{parts[2]}/{parts[3]}", "/".join(parts[5:]))
        if path.endswith(".git/info/lfs/objects/batch"):
            repo_id = path.strip("/").removesuffix(".git/info/lfs/objects/batch")
            return self.lfs_batch(repo_id, json.loads(body))
        if path.startswith("/lfs-verify/"):
            oid = json.loads(body)["oid"]
            return self.reply(200 if oid in self.state.lfs else 404, {"success": oid in self.state.lfs})
        self.error(404, "EntryNotFound", f"no route POST {path}")

    def do_PUT(self):
        path = urlparse(self.path).path
        if path.startswith("/lfs-upload/"):
            oid = path.rsplit("/", 1)[-1]
            if self.state.stop_on_lfs_put:
                self.server.stop_async()
                self.close_connection = True
                return
            data = self.body()
            if hashlib.sha256(data).hexdigest() != oid:
                return self.error(400, "BadRequest", "sha256 mismatch")
            with self.state.lock:
                self.state.lfs[oid] = data
                self.state.lfs_puts.append(oid)
            return self.reply(200, {})
        self.error(404, "EntryNotFound", f"no route PUT {path}")

    def do_GET(self):
        self.read(head=False)

    def do_HEAD(self):
        self.read(head=True)

    def read(self, head: bool):
        path = unquote(urlparse(self.path).path)
        parts = path.strip("/").split("/")
        if len(parts) >= 6 and parts[:2] == ["api", "models"] and parts[4] == "tree":
            repo = self.repo_for_read(f"{parts[2]}/{parts[3]}", head)
            if repo:
                files = self.files_at(repo, parts[5])
                if files is None:
                    return self.error(404, "RevisionNotFound", f"revision {parts[5]} not found", head=head)
                entries = [{"type": "file", "path": p, "size": len(d), "oid": git_blob_sha1(d),
                            **({"lfs": {"oid": hashlib.sha256(d).hexdigest(), "size": len(d), "pointerSize": 130}}
                               if self.is_lfs(p, d) else {})} for p, d in sorted(files.items())]
                self.reply(200, entries, head=head)
            return
        if len(parts) >= 5 and parts[2] == "resolve":
            repo = self.repo_for_read(f"{parts[0]}/{parts[1]}", head)
            if repo is None:
                return
            revision, file_path = parts[3], "/".join(parts[4:])
            files = self.files_at(repo, revision)
            if files is None:
                return self.error(404, "RevisionNotFound", f"revision {revision} not found", head=head)
            if file_path not in files:
                return self.error(404, "EntryNotFound", f"{file_path} not found", head=head)
            data = files[file_path]
            commit = repo.branches.get(revision, revision)
            etag = hashlib.sha256(data).hexdigest() if self.is_lfs(file_path, data) else git_blob_sha1(data)
            headers = {"X-Repo-Commit": commit, "ETag": f'"{etag}"'}
            if self.is_lfs(file_path, data):
                headers.update({"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(data))})
            return self.reply(200, raw=data, headers=headers, head=head)
        self.error(404, "EntryNotFound", f"no route GET {path}", head=head)

    # -- operations ----------------------------------------------------------------------
    @staticmethod
    def is_lfs(path: str, data: bytes) -> bool:
        return path.endswith(".safetensors") or len(data) > LFS_THRESHOLD

    def files_at(self, repo: Repo, revision: str) -> dict[str, bytes] | None:
        oid = repo.branches.get(revision, revision)
        return repo.commits.get(oid)

    def create_repo(self, req: dict):
        user = self.user()
        if user is None:
            return self.error(401, "InvalidCredentials", "Invalid credentials in Authorization header")
        owner = req.get("organization") or user
        if owner != user:
            return self.error(403, "Forbidden", f"you cannot create repositories under {owner}")
        repo_id = f"{owner}/{req['name']}"
        url = f"{self.base()}/{repo_id}"
        with self.state.lock:
            if repo_id in self.state.repos:
                return self.reply(409, {"error": "You already created this model repo", "url": url},
                                  {"X-Error-Code": "RepoExists"})
            private = bool(req.get("private")) or req.get("visibility") == "private"
            repo = Repo(owner, private)
            repo.commits["0" * 40] = {}
            repo.branches["main"] = "0" * 40
            self.state.repos[repo_id] = repo
        self.reply(200, {"url": url, "name": repo_id})

    def create_branch(self, repo_id: str, branch: str):
        repo = self.repo_for_write(repo_id)
        if repo:
            if branch in repo.branches:
                return self.error(409, "BranchExists", f"branch {branch} exists")
            repo.branches[branch] = repo.branches["main"]
            self.reply(200, {})

    def preupload(self, repo_id: str, req: dict):
        repo = self.repo_for_write(repo_id)
        if repo is None:
            return
        current = self.files_at(repo, "main") or {}
        out = []
        for f in req["files"]:
            lfs = f["path"].endswith(".safetensors") or f["size"] > LFS_THRESHOLD
            existing = current.get(f["path"])
            oid = None
            if existing is not None:
                oid = hashlib.sha256(existing).hexdigest() if self.is_lfs(f["path"], existing) else git_blob_sha1(existing)
            out.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False,
                        "oid": oid})
        self.reply(200, {"files": out, "commitOid": repo.branches["main"]})

    def lfs_batch(self, repo_id: str, req: dict):
        if self.repo_for_write(repo_id) is None:
            return
        objects = []
        for obj in req["objects"]:
            entry = {"oid": obj["oid"], "size": obj["size"]}
            if obj["oid"] not in self.state.lfs:
                entry["actions"] = {
                    "upload": {"href": f"{self.base()}/lfs-upload/{obj['oid']}"},
                    "verify": {"href": f"{self.base()}/lfs-verify/{obj['oid']}"},
                }
            objects.append(entry)
        self.reply(200, {"transfer": "basic", "objects": objects, "hash_algo": "sha256"})

    def commit(self, repo_id: str, revision: str, body: bytes):
        repo = self.repo_for_write(repo_id)
        if repo is None:
            return
        if self.state.fail_next_commits:
            self.state.fail_next_commits -= 1
            return self.error(503, "ServiceUnavailable", "try again")
        lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        self.state.commit_payloads.append(lines)
        with self.state.lock:
            files = dict(self.files_at(repo, revision) or {})
            for line in lines:
                key, value = line["key"], line["value"]
                if key == "file":
                    files[value["path"]] = base64.b64decode(value["content"])
                elif key == "lfsFile":
                    if value["oid"] not in self.state.lfs:
                        return self.error(422, "LfsObjectMissing", f"LFS object {value['oid']} was never uploaded")
                    files[value["path"]] = self.state.lfs[value["oid"]]
                elif key in ("deletedFile", "deletedFolder"):
                    files = {p: d for p, d in files.items() if p != value["path"] and not p.startswith(value["path"] + "/")}
            oid = hashlib.sha1(json.dumps(sorted((p, hashlib.sha256(d).hexdigest()) for p, d in files.items())).encode()
                               + str(len(repo.commits)).encode()).hexdigest()
            repo.commits[oid] = files
            repo.branches[revision] = oid
        self.reply(200, {"success": True, "commitOid": oid, "commitUrl": f"{self.base()}/{repo_id}/commit/{oid}",
                         "pullRequestUrl": None})


class HubServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, tokens: dict[str, str]):
        super().__init__(("127.0.0.1", 0), Handler)
        self.state = HubState(tokens)
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def start(self) -> "HubServer":
        self.thread.start()
        return self

    def stop_async(self) -> None:
        """Stop serving and close the listening socket (from inside a handler)."""
        threading.Thread(target=lambda: (self.shutdown(), self.server_close()), daemon=True).start()

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
