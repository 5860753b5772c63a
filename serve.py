"""Serve a trained model over the OpenAI API: /v1/completions, /v1/chat/completions (streaming too), /v1/models.

    python serve.py runs/default --port 8000                  # on 127.0.0.1; --host 0.0.0.0 to open it up
    python serve.py runs/chat --api_key secret --max_batch 16
Any OpenAI client then works:  OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="secret")
The model loads like the REPL's (a checkpoint, run or Hugging Face folder, hf:ORG/NAME; --best) and generates
through the same engine. Requests that arrive together are batched, each row with its own settings; the rest queue.
A bad request gets a 400 with an OpenAI-style error body naming the parameter, and the server goes on.
Limits: a request body of at most 1 MiB (MAX_BODY; 413 past it), at most 4 stop strings of at most 256
characters each, n up to 16, seed and top_k up to 2**63 - 1; JSON's Infinity and NaN, and lone surrogates
("\\ud800") in any field, are refused.
"""

import argparse
import asyncio
import json
import math
import os
import queue
import signal
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field, replace

if __name__ == "__main__":  # a Ctrl-C while torch imports ends quietly (status 130); error_contract then takes over
    signal.signal(signal.SIGINT, signal.SIG_DFL)

from config import ConfigError, SampleConfig
from errors import RunFailure, error_contract, exit_code
from engine import check_prompt, generate
from hf_hub import HF_PREFIX, is_hub_name
from text_generator import load_for_inference
from tokenizer import can_chat, chat_prompt_ids, stop_ids

try:  # optional until serving: main() names what to install
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import ClientDisconnect
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route
except ImportError:
    uvicorn = None

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
GATHER_S = 0.005  # after a request arrives, how long the worker waits for others to batch with it
MAX_BODY = 2**20  # bytes of a request body: the text of a 32k-token context is about 128 KB
MAX_STOP, MAX_STOP_CHARS = 4, 256  # OpenAI's 4 stop strings; each one's prefixes are checked at every token
MAX_N = 16  # choices per request
INT64_MAX = 2**63 - 1  # a seed or top_k past torch's int64 overflows in the worker


class BadRequest(Exception):
    """A request the server refuses: HTTP status, message, the parameter at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind


@dataclass
class Event:
    """What the worker tells a request: new text of a choice; once per choice, why it ended (the engine's
    reason) and its token count; or instead a failure, which ends the request."""
    choice: int = 0
    text: str = ""
    finish_reason: str | None = None  # "stop": an end token or a stop string; "length": max_tokens or the context
    tokens: int = 0  # the choice's new tokens, sent with its finish_reason
    error: BadRequest | None = None


@dataclass
class Job:
    """One request on its way through the worker: what to generate, and the events that come back."""
    ids: list[int]
    settings: SampleConfig
    chat: bool
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    heard: bool = False  # an event went out: a failed batch can no longer be retried for this job
    cancelled: bool = False

    def put(self, event: Event):
        self.heard = True
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    async def stream(self):
        """The job's events until each choice has ended or the worker failed it: what every answer reads."""
        left = self.settings.num_return_sequences
        while left:
            event = await self.events.get()
            yield event
            left = 0 if event.error else left - (event.finish_reason is not None)


class Worker(threading.Thread):
    """Runs the engine on batches of queued jobs, one batch at a time (rows never mix: each has its own)."""

    def __init__(self, model, tokenizer, max_batch: int):
        super().__init__(daemon=True)
        self.model, self.tokenizer, self.max_batch, self.jobs = model, tokenizer, max_batch, queue.Queue()

    def run(self):
        while True:
            batch = [self.jobs.get()]
            deadline = time.monotonic() + GATHER_S
            while len(batch) < self.max_batch and (left := deadline - time.monotonic()) > 0:
                try:
                    batch.append(self.jobs.get(timeout=left))
                except queue.Empty:
                    break
            chat, plain = [j for j in batch if j.chat], [j for j in batch if not j.chat]
            for group in (chat, plain):  # the end tokens differ: <|im_end|> ends a chat reply
                if group:
                    self.serve(group)

    def serve(self, jobs: list[Job]):
        owner = [(j, k) for j in jobs for k in range(j.settings.num_return_sequences)]  # row -> (job, choice)
        reasons = {}  # row -> why it ended
        try:
            out = generate(self.model, [j.ids for j in jobs], [j.settings for j in jobs],
                           stop_ids(self.tokenizer, chat=jobs[0].chat), self.tokenizer,
                           on_text=lambda i, text: owner[i][0].put(Event(owner[i][1], text)),
                           cancelled=lambda i: owner[i][0].cancelled, on_end=reasons.__setitem__)
        except Exception as e:  # the engine's refusal (memory), or a bug: the requests fail, the server goes on
            if len(jobs) > 1 and not any(j.heard for j in jobs):
                for j in jobs:  # nothing sent yet: each request alone, so one's failure stays its own
                    self.serve([j])
                return
            for j in jobs:
                j.put(Event(error=failure(e)))
            return
        for i, ((job, k), ids) in enumerate(zip(owner, out)):
            if i in reasons:  # a cancelled row has no reason, and no reader
                job.put(Event(k, finish_reason=reasons[i], tokens=len(ids)))


def failure(e: Exception) -> BadRequest:
    """A failed generation's answer, by the scripts' own classes (errors.exit_code): 400 for bad input (a batch
    too big for memory), else 500; a bug's traceback goes to the log."""
    try:
        code, line = exit_code(e)
    except Exception:  # exit_code raises a bug again: keep its traceback, in the log
        traceback.print_exception(e)
        code, line = 1, None
    message = line or str(e)
    return BadRequest(message) if code == 2 else BadRequest(message, status=500, kind="server_error")


# ----------------------------------------------------------------------------- requests

async def read_json(request) -> dict:
    """The request's JSON object, read up to MAX_BODY bytes (413 past them, before reading when the length
    says so); BadRequest otherwise."""
    too_big = BadRequest(f"the request body is over {MAX_BODY} bytes; send a shorter prompt", status=413)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY:
        raise too_big
    data = bytearray()
    try:
        async for part in request.stream():
            data += part
            if len(data) > MAX_BODY:  # a chunked body has no length to check first: stop reading it here
                raise too_big
    except ClientDisconnect:
        raise BadRequest("the client left before sending the whole body") from None
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):  # ValueError: bad JSON or UTF-8, an integer of over 4300 digits
        raise BadRequest("the request body is not valid JSON (or nests too deeply); send a JSON object") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    check_text(body)
    return body


def check_text(body: dict):
    """Refuse a field holding a lone surrogate (JSON's "\\ud800"): no tokenizer or UTF-8 answer can carry one."""
    for name, value in body.items():
        try:
            json.dumps({name: value}, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            name = name.encode("utf-8", "backslashreplace").decode()  # the name itself may hold the surrogate
            raise BadRequest(f"{name} holds a lone surrogate (an unpaired \\ud800-\\udfff escape), which is not "
                             "text; send valid Unicode", name) from None
        except RecursionError:
            raise BadRequest(f"{name} nests too deeply", name) from None


def number(body: dict, name: str, default, kind=float, low=None, high=None):
    """body[name], or default when absent or null, as a finite int or float in [low, high]; BadRequest naming it."""
    value = body.get(name)
    value = default if value is None else value
    finite = isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))  # JSON allows Infinity
    if isinstance(value, bool) or not finite or (kind is int and value != int(value)):
        raise BadRequest(f"{name} must be a{'n integer' if kind is int else ' finite number'}, got {value!r:.40}", name)
    if (low is not None and value < low) or (high is not None and value > high):
        raise BadRequest(f"{name}={value!r:.40} is out of range [{low}, {high}]", name)
    return kind(value)


def settings_of(body: dict, ctx: int, chat: bool = False) -> SampleConfig:
    """SampleConfig from an OpenAI request body; BadRequest naming the parameter when a value is wrong. Without
    max_tokens a completion gets OpenAI's 16 tokens and a chat reply the rest of the context."""
    default = number(body, "max_completion_tokens", ctx if chat else DEFAULT_MAX_TOKENS, int, 1, ctx)
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) for s in stop):
        raise BadRequest(f"stop must be a string or a list of at most {MAX_STOP} strings", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise BadRequest(f"a stop string has {max(map(len, stop))} characters, more than the {MAX_STOP_CHARS} "
                         "allowed; shorten it", "stop")
    try:
        return SampleConfig(max_new_tokens=number(body, "max_tokens", default, int, 1, ctx),
                            temperature=number(body, "temperature", 1.0, float, 0, 2),
                            top_p=max(number(body, "top_p", 1.0, float, 0, 1), 1e-9),
                            top_k=max(number(body, "top_k", 0, int, -1, INT64_MAX), 0),  # -1: off, as in vLLM
                            seed=number(body, "seed", -1, int, -1, INT64_MAX),
                            num_return_sequences=number(body, "n", 1, int, 1, MAX_N),
                            stop=stop, repetition_penalty=1.0, compile="false")
    except ConfigError as e:
        raise BadRequest(str(e), getattr(e, "field", None)) from None


class Server:
    """The model, its tokenizer and the worker: what the handlers reach as request.app.state.server."""

    def __init__(self, args):
        self.model, self.tokenizer, self.config, self.path = load_for_inference(args.path, args.device, args.best,
                                                                                args.quantize)
        named = args.path if is_hub_name(args.path) else self.path  # a Hub model by its name, not its cache folder
        self.name, self.api_key, self.compile = args.name or model_name(named), args.api_key, args.compile
        self.worker = Worker(self.model, self.tokenizer, args.max_batch)
        self.worker.start()

    def job(self, body: dict, chat: bool) -> Job:
        """The request as a job for the worker, every value checked first: a bad one never joins a batch."""
        if body.get("model") not in (None, self.name):
            raise BadRequest(f"model {body.get('model')!r:.80} does not exist, this server has {self.name!r}", "model")
        if chat:
            if not can_chat(self.tokenizer):
                raise BadRequest("this model was not trained on conversations (its tokenizer has no <|im_start|>); "
                                 "use /v1/completions", "messages")
            try:
                ids = chat_prompt_ids(self.tokenizer, body.get("messages"))
            except ValueError as e:
                raise BadRequest(f"messages: {e}", "messages") from None
        else:
            prompt = body.get("prompt", "")
            prompt = prompt[0] if isinstance(prompt, list) and len(prompt) == 1 else prompt
            if not isinstance(prompt, str):
                raise BadRequest("prompt must be a string (one prompt per request)", "prompt")
            ids = self.tokenizer.encode(prompt, add_special_tokens=False) or stop_ids(self.tokenizer)[:1] or [0]
        try:
            check_prompt(len(ids), self.config.max_seq_len)
        except ConfigError as e:
            raise BadRequest(str(e), "messages" if chat else "prompt") from None
        settings = settings_of(body, self.config.max_seq_len, chat)
        return Job(ids, replace(settings, compile=self.compile), chat, asyncio.get_running_loop())


def model_name(path: str) -> str:
    """A model's name in the API: its run folder's for a checkpoint (runs/mine/checkpoints/step_N: mine), ORG/NAME
    for hf:ORG/NAME, else its folder's."""
    if is_hub_name(path):
        return path[len(HF_PREFIX):]
    parts = os.path.normpath(os.path.abspath(path)).split(os.sep)
    return parts[-3] if len(parts) >= 3 and parts[-2] == "checkpoints" else parts[-1]


# ----------------------------------------------------------------------------- the API

def error_body(e: BadRequest) -> dict:
    return {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": None}}


def refuse(e: BadRequest):
    return JSONResponse(error_body(e), status_code=e.status)


def authorised(request) -> bool:
    key = request.app.state.server.api_key
    return not key or request.headers.get("authorization") == f"Bearer {key}"


async def models(request):
    server = request.app.state.server
    if not authorised(request):
        return refuse(BadRequest("invalid API key", status=401, kind="authentication_error"))
    return JSONResponse({"object": "list", "data": [{"id": server.name, "object": "model", "created": 0,
                                                     "owned_by": "modern-llm"}]})


async def completions(request):
    return await complete(request, chat=False)


async def chat_completions(request):
    return await complete(request, chat=True)


async def complete(request, chat: bool):
    """A completion or chat request: checked whole, queued for the worker, answered whole or streamed."""
    server = request.app.state.server
    if not authorised(request):
        return refuse(BadRequest("invalid API key: send Authorization: Bearer KEY", status=401,
                                 kind="authentication_error"))
    try:
        body = await read_json(request)
        if body.get("stream") is not None and not isinstance(body["stream"], bool):
            raise BadRequest("stream must be true or false", "stream")
        job = server.job(body, chat)
    except BadRequest as e:
        return refuse(e)
    server.worker.jobs.put(job)
    meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", "created": int(time.time()),
            "model": server.name}
    if body.get("stream"):
        return StreamingResponse(streamed(job, meta, chat), media_type="text/event-stream")
    return await whole(job, meta, chat)


async def whole(job: Job, meta: dict, chat: bool):
    """The answer in one JSON object, once every choice has ended."""
    n = job.settings.num_return_sequences
    texts, reasons, used = [""] * n, [None] * n, 0
    async for event in job.stream():
        if event.error:
            return refuse(event.error)
        texts[event.choice] += event.text
        reasons[event.choice] = event.finish_reason or reasons[event.choice]
        used += event.tokens
    choices = [{"index": i, "finish_reason": reason, **({"message": {"role": "assistant", "content": text}} if chat
                                                        else {"text": text, "logprobs": None})}
               for i, (text, reason) in enumerate(zip(texts, reasons))]
    prompt_tokens = len(job.ids)
    return JSONResponse({**meta, "object": "chat.completion" if chat else "text_completion", "choices": choices,
                         "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": used,
                                   "total_tokens": prompt_tokens + used}})


async def streamed(job: Job, meta: dict, chat: bool):
    """The answer as server-sent events, a chunk per piece of text and one per choice's end, then [DONE]."""
    def chunk(i, text=None, finish=None, role=False):
        if chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": i, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": i, "text": text or "", "finish_reason": finish, "logprobs": None}
        kind = "chat.completion.chunk" if chat else "text_completion"
        return f"data: {json.dumps({**meta, 'object': kind, 'choices': [choice]})}\n\n"
    try:
        if chat:
            for i in range(job.settings.num_return_sequences):
                yield chunk(i, role=True)
        async for event in job.stream():
            if event.error:
                yield f"data: {json.dumps(error_body(event.error))}\n\n"
                return
            if event.text:
                yield chunk(event.choice, event.text)
            if event.finish_reason:
                yield chunk(event.choice, finish=event.finish_reason)
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled = True  # a client gone mid-stream frees its row at the next read; no-op when finished


def app_for(server: Server):
    """The Starlette application: the routes, with the server in app.state."""
    app = Starlette(routes=[Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"]),
                            Route("/v1/chat/completions", chat_completions, methods=["POST"])])
    app.state.server = server
    return app


@error_contract
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", nargs="?", default="", help="checkpoint, run or Hugging Face folder, or hf:ORG/NAME "
                                                       "(default: the default run folder)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on; 0.0.0.0 opens it to the network")
    p.add_argument("--port", type=int, default=8000, help="1 to 65535")
    p.add_argument("--api_key", default="", help="require Authorization: Bearer KEY on every request")
    p.add_argument("--name", default="", help="the model's name in the API (default: the folder's)")
    p.add_argument("--best", action="store_true", help="a run folder's best checkpoint, not its newest")
    p.add_argument("--device", default="auto")
    p.add_argument("--compile", choices=["auto", "true", "false"], default="auto",
                   help="compile the decode step (auto: on CUDA)")
    p.add_argument("--quantize", choices=["none", "int8"], default="none")
    p.add_argument("--max_batch", type=int, default=8, help="requests generated together at most")
    args = p.parse_args(argv)
    if not 0 < args.port < 2**16:
        raise ConfigError(f"--port {args.port} is out of range, use a port from 1 to 65535")
    if uvicorn is None:
        raise RunFailure("serving needs starlette and uvicorn: pip install -r requirements.txt")
    server = Server(args)
    print(f"serving {server.path} as {server.name!r} on http://{args.host}:{args.port}/v1", file=sys.stderr,
          flush=True)
    uvicorn.run(app_for(server), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
