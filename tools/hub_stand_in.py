"""A stand-in for the Hugging Face Hub on 127.0.0.1: the few routes huggingface_hub 2.x calls to list a dataset or
model repository and download its files, enough that HF_ENDPOINT can point at it in tests.

    GET  /api/datasets/OWNER/NAME/revision/REV          the repository's info: its commit (sha)
    GET  /api/datasets/OWNER/NAME/tree/REV[/FOLDER]     the files under a folder (one page, recursive)
    HEAD /datasets/OWNER/NAME/resolve/REV/PATH          X-Repo-Commit, ETag (the sha256), Content-Length
    GET  /datasets/OWNER/NAME/resolve/REV/PATH          the bytes, or from a Range's start (206)
and the same for a model: /api/models/OWNER/NAME/..., /OWNER/NAME/resolve/REV/PATH (one set of repositories serves
both kinds). Errors carry the X-Error-Code the Hub sends (RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo),
which huggingface_hub turns into its error classes. `stall` holds a file's download after some bytes, for a kill;
`cut` drops a download's connection; `private` asks for a token; `redirect` sends a file's downloads to a second
server, as the Hub sends large files to its CDN; `git` gives a file the ETag of a file kept in git; `etags`,
`listed`, `revisions` and `commit` make it a hostile Hub, for the checks of what it sends.
"""

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

COMMIT = "c0ffee" + "0" * 34


class Hub:
    """Serves `repos` ({"OWNER/NAME": {path: bytes}}); `gated` names repositories whose files need accepted
    terms; `stall` = (path, bytes) holds that file's GET after those bytes until stop(); `cut` = (path, bytes,
    times) closes the connection after those bytes of the file's next `times` GETs; `ranges` False sends the
    whole file whatever Range is asked (200), as some proxies and CDNs do; `requests` logs what was asked,
    `tokens` the Authorization headers. `private` {"OWNER/NAME": token}: that repository is shown to that
    token only, and once one is set, a token not among them is refused as invalid (401), as the Hub refuses
    one it never issued; `forbidden` names tokens it knows whose rights do not reach a private repository
    (403, as for a fine-grained token without read access). `redirect` names files whose HEAD and GET are
    answered 302 to the second server at `cdn_url` (another port: another host to a client), with the hash in
    X-Linked-Etag and the size in X-Linked-Size as the Hub sends them, and another hash in ETag (the git blob
    id of its LFS pointer); `cdn_requests` logs what that server was asked, with the Authorization header it
    saw. `git` names files whose ETag is their git blob id (sha1 of "blob SIZE\\0" and the bytes), as for a
    small file the Hub keeps in git. A hostile Hub: `etags` {path: ETag, or a list of them for its HEADs in
    turn} answers in place of the sha256 (or git blob id), `listed` adds entries to every listing, `revisions`
    are the revisions it says exist (besides main and COMMIT), `commit` is the one the repository's info
    names."""

    def __init__(self, repos: dict, gated=(), stall=None):
        self.repos, self.gated, self.stall = repos, set(gated), stall
        self.etags, self.listed, self.revisions, self.commit, self.private = {}, [], set(), COMMIT, {}
        self.forbidden, self.redirect, self.git, self.cdn_requests, self.cut = set(), set(), set(), [], None
        self.ranges = True
        self.requests, self.tokens, self.stalled, self.release = ([], set(),
                                                                  threading.Event(), threading.Event())
        self.server, self.url = _serve(_handler(self))
        self.cdn_server, self.cdn_url = _serve(_cdn_handler(self))

    def stop(self):
        self.release.set()
        for server in (self.server, self.cdn_server):
            server.shutdown()
            server.server_close()

    def gets(self, path: str) -> list:
        """The Range headers (None: none) of every GET of a file."""
        return [r for method, p, r in self.requests if method == "GET" and p.endswith("/" + path)]


def _serve(handler) -> tuple:
    """A server on 127.0.0.1 at a free port, answering in threads: (the server, its URL)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()  # stops fast
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def git_blob_id(data: bytes) -> str:
    """A file's id in git, the ETag the Hub sends for a file it keeps in git rather than LFS."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _range_start(headers) -> int:
    return int(headers["Range"].split("=")[1].split("-")[0]) if headers.get("Range") else 0


def _send_bytes(handler, data: bytes, start: int, headers: dict, body: bool, send=None):
    """A file's bytes from start (206 with a Content-Range when not 0), with headers."""
    handler.send_response(206 if start else 200)
    for key, value in {**headers, "Accept-Ranges": "bytes", "Content-Length": str(len(data) - start)}.items():
        handler.send_header(key, value)
    if start:
        handler.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
    handler.end_headers()
    if body:
        (send or handler.wfile.write)(data[start:])


def _handler(hub: Hub):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet: the tests read hub.requests
            pass

        def do_HEAD(self):
            self._route(body=False)

        def do_GET(self):
            self._route(body=True)

        def _route(self, body: bool):
            path = urlparse(self.path).path
            hub.requests.append((self.command, unquote(path), self.headers.get("Range")))
            # a revision's %2F stays in its part
            parts = [unquote(part) for part in path.strip("/").split("/")]
            if parts[:2] in (["api", "datasets"], ["api", "models"]) and len(parts) >= 6:
                self._api("/".join(parts[2:4]), parts[4], parts[5], "/".join(parts[6:]))
            elif parts[:1] == ["datasets"] and len(parts) >= 6 and parts[3] == "resolve":
                self._file("/".join(parts[1:3]), parts[4], "/".join(parts[5:]), body)
            elif parts[:1] != ["api"] and len(parts) >= 5 and parts[2] == "resolve":
                self._file("/".join(parts[:2]), parts[3], "/".join(parts[4:]), body)
            # huggingface_hub's other calls (its agent-harness list) are not ours: their tokens are not logged
            else:
                self._error(404, "RepoNotFound")

        def _repo(self, repo: str, revision: str) -> dict | None:
            token = self.headers.get("Authorization")
            hub.tokens.add(token)
            known = {f"Bearer {t}" for t in (*hub.private.values(), *hub.forbidden)}
            if token and hub.private and token not in known:
                # one it never issued
                return self._error(401, None, "Invalid credentials in Authorization header")
            if repo in hub.private and token in {f"Bearer {t}" for t in hub.forbidden}:
                return self._error(403, None, "Forbidden: the token has no read access to this repository")
            if repo in hub.private and token != f"Bearer {hub.private[repo]}":
                return self._error(404 if token else 401, "RepoNotFound")  # as for a name it does not have
            if repo not in hub.repos:
                return self._error(404, "RepoNotFound")
            if revision not in ("main", COMMIT, hub.commit, *hub.revisions):
                return self._error(404, "RevisionNotFound")
            return hub.repos[repo]

        def _api(self, repo: str, route: str, revision: str, folder: str):
            files = self._repo(repo, revision)
            if files is None:
                return
            if route == "revision":
                return self._json({"id": repo, "sha": hub.commit, "private": repo in hub.private,
                                   "gated": repo in hub.gated})
            listed = [{"type": "file", "path": p, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                      for p, data in sorted(files.items())
                      if not folder or p.startswith(folder + "/")] + hub.listed
            if not listed:
                return self._error(404, "EntryNotFound")
            self._json(listed)

        def _file(self, repo: str, revision: str, name: str, body: bool):
            files = self._repo(repo, revision)
            if files is None:
                return
            if repo in hub.gated:
                return self._error(403, "GatedRepo")
            if name not in files:
                return self._error(404, "EntryNotFound")
            data = files[name]
            if name in hub.redirect:  # to the CDN, signed (the token stays here), the hash in X-Linked-Etag
                sha256 = hashlib.sha256(data).hexdigest()
                pointer = (f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\n"
                           f"size {len(data)}\n")
                self.send_response(302)
                for key, value in {"Location": f"{hub.cdn_url}/{repo}/{name}?X-Amz-Signature=standin",
                                   "X-Repo-Commit": COMMIT, "ETag": f'"{git_blob_id(pointer.encode())}"',
                                   "X-Linked-Etag": f'"{self._etag(name, data)}"',
                                   "X-Linked-Size": str(len(data)), "Content-Length": "0"}.items():
                    self.send_header(key, value)
                return self.end_headers()
            _send_bytes(self, data, _range_start(self.headers) if hub.ranges else 0, {"X-Repo-Commit": COMMIT,
                        "ETag": f'"{self._etag(name, data)}"'}, body, lambda part: self._send(part, name))

        def _etag(self, name: str, data: bytes) -> str:
            etag = hub.etags.get(name, (git_blob_id(data) if name in hub.git
                                        else hashlib.sha256(data).hexdigest()))
            if not isinstance(etag, list):
                return etag
            asked = sum(method == "HEAD" and p.endswith("/" + name) for method, p, _ in hub.requests)
            return etag[min(asked, len(etag)) - 1]  # the last one for every HEAD after

        def _send(self, data: bytes, name: str):
            if hub.cut and hub.cut[0] == name and hub.cut[2] > 0:  # the connection drops after some bytes
                hub.cut = (name, hub.cut[1], hub.cut[2] - 1)
                self.wfile.write(data[:hub.cut[1]])
                self.wfile.flush()
                self.close_connection = True
                return
            if hub.stall and hub.stall[0] == name:
                self.wfile.write(data[:hub.stall[1]])
                self.wfile.flush()
                hub.stalled.set()
                hub.release.wait()  # the client waits here until it is killed
                return
            self.wfile.write(data)

        def _json(self, obj):
            data = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command == "GET":
                self.wfile.write(data)

        def _error(self, status: int, code: str | None, message: str | None = None):
            self.send_response(status)
            if code:
                self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message or f"{code} (stand-in)")
            self.send_header("Content-Length", "0")
            self.end_headers()

    return Handler


def _cdn_handler(hub: Hub):
    """The second server: a redirected file's bytes at /OWNER/NAME/PATH, whatever the signature; it logs every
    request with the Authorization header it came with (none, from a client that keeps the token on the Hub).
    """
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_HEAD(self):
            self._file(body=False)

        def do_GET(self):
            self._file(body=True)

        def _file(self, body: bool):
            path = unquote(urlparse(self.path).path).strip("/")
            hub.cdn_requests.append((self.command, path, self.headers.get("Range"),
                                     self.headers.get("Authorization")))
            repo, name = "/".join(path.split("/")[:2]), "/".join(path.split("/")[2:])
            data = hub.repos.get(repo, {}).get(name)
            if data is None:
                self.send_response(404)
                self.send_header("Content-Length", "0")
                return self.end_headers()
            _send_bytes(self, data, _range_start(self.headers), {}, body)

    return Handler
