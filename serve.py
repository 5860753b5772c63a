"""Serve a trained model over the OpenAI API: /v1/completions, /v1/chat/completions (streaming too), /v1/models.

    python serve.py runs/default --port 8000                  # on 127.0.0.1; --host 0.0.0.0 to open it up
    python serve.py runs/chat --api_key secret --max_batch 16
Any OpenAI client then works:  OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="secret")
The model loads like the REPL's (a checkpoint, run or Hugging Face folder; --best) and generates through the
same engine. Requests that arrive together are batched, each row with its own settings; the rest queue.
A bad request gets a 400 with an OpenAI-style error body and the server goes on.
"""

import argparse
import asyncio
import json
import os
import queue
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field, replace

from config import ConfigError, SampleConfig
from errors import RunFailure, error_contract
from engine import generate
from text_generator import load_for_inference
from tokenizer import can_chat, chat_prompt_ids, stop_ids

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
GATHER_S = 0.005  # after a request arrives, how long the worker waits for others to batch with it


class BadRequest(Exception):
    """A request the server refuses: HTTP status, message, the parameter at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind


@dataclass
class Job:
    """One request's rows on their way through the worker: what to generate and where the text goes."""
    ids: list[int]
    settings: SampleConfig
    chat: bool
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # ("text", i, str), then ("done", ids lists)
    cancelled: bool = False

    def put(self, *event):
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


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
        try:
            out = generate(self.model, [j.ids for j in jobs], [j.settings for j in jobs],
                           stop_ids(self.tokenizer, chat=jobs[0].chat), self.tokenizer,
                           on_text=lambda i, text: owner[i][0].put("text", owner[i][1], text),
                           cancelled=lambda i: owner[i][0].cancelled)
        except Exception as e:  # the engine's refusal (memory), or a bug: the requests fail, the server goes on
            for j in jobs:
                j.put("error", str(e))
            return
        for j in jobs:
            j.put("done", [ids for (owner_job, _), ids in zip(owner, out) if owner_job is j])


# ----------------------------------------------------------------------------- requests

def settings_of(body: dict, ctx: int, prompt_tokens: int, chat: bool = False) -> SampleConfig:
    """SampleConfig from an OpenAI request body; BadRequest naming the parameter when a value is wrong. Without
    max_tokens a completion gets OpenAI's 16 tokens and a chat reply the rest of the context."""
    def number(name, default, kind=float, low=None, high=None):
        value = body.get(name, default)
        if value is None:
            value = default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
            raise BadRequest(f"{name} must be a{'n integer' if kind is int else ' number'}, got {value!r}", name)
        if (low is not None and value < low) or (high is not None and value > high):
            raise BadRequest(f"{name}={value} is out of range [{low}, {high}]", name)
        return kind(value)
    default = body.get("max_completion_tokens") or (ctx if chat else DEFAULT_MAX_TOKENS)
    max_tokens = number("max_tokens", default, int, 1, ctx)
    if prompt_tokens >= ctx:
        raise BadRequest(f"the prompt has {prompt_tokens} tokens; the model's context is {ctx}", "prompt")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 4:
        raise BadRequest("stop must be a string or a list of at most 4 strings", "stop")
    try:
        return SampleConfig(max_new_tokens=max_tokens, temperature=number("temperature", 1.0, float, 0, 2),
                            top_p=max(number("top_p", 1.0, float, 0, 1), 1e-9), top_k=0, stop=stop,
                            seed=number("seed", -1, int, -1), num_return_sequences=number("n", 1, int, 1, 16),
                            repetition_penalty=1.0, compile="false")
    except ConfigError as e:
        raise BadRequest(str(e)) from None


def finish_reason(ids: list[int], settings: SampleConfig, prompt_tokens: int, ctx: int) -> str:
    return "length" if len(ids) >= min(settings.max_new_tokens, ctx - prompt_tokens) else "stop"


class Server:
    """The model, its tokenizer, the worker, and the handlers of the API."""

    def __init__(self, args):
        self.model, self.tokenizer, self.config, self.path = load_for_inference(args.path, args.device, args.best,
                                                                                args.quantize)
        self.name, self.api_key, self.compile = args.name or model_name(self.path), args.api_key, args.compile
        self.worker = Worker(self.model, self.tokenizer, args.max_batch)
        self.worker.start()

    def job(self, body: dict, chat: bool) -> tuple[Job, int]:
        if body.get("model") not in (None, self.name):
            raise BadRequest(f"model {body.get('model')!r} does not exist, this server has {self.name!r}", "model")
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
        settings = settings_of(body, self.config.max_seq_len, len(ids), chat)
        compiled = replace(settings, compile=self.compile)
        return Job(ids, compiled, chat, asyncio.get_running_loop()), len(ids)


def model_name(path: str) -> str:
    """A model's name in the API: its run folder's for a checkpoint (runs/mine/checkpoints/step_N: mine), else
    its folder's."""
    parts = os.path.normpath(os.path.abspath(path)).split(os.sep)
    return parts[-3] if len(parts) >= 3 and parts[-2] == "checkpoints" else parts[-1]


def error_body(e: BadRequest) -> dict:
    return {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": None}}


def app_for(server: Server):
    """The Starlette application: routes, the API key check, OpenAI-style errors."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    def refuse(e: BadRequest):
        return JSONResponse(error_body(e), status_code=e.status)

    def authorised(request) -> bool:
        return not server.api_key or request.headers.get("authorization") == f"Bearer {server.api_key}"

    async def models(request):
        if not authorised(request):
            return refuse(BadRequest("invalid API key", status=401, kind="authentication_error"))
        return JSONResponse({"object": "list", "data": [{"id": server.name, "object": "model", "created": 0,
                                                         "owned_by": "modern-llm"}]})

    async def complete(request, chat: bool):
        if not authorised(request):
            return refuse(BadRequest("invalid API key: send Authorization: Bearer KEY", status=401,
                                     kind="authentication_error"))
        try:
            body = json.loads(await request.body())
            if not isinstance(body, dict):
                raise BadRequest("the request body must be a JSON object")
            job, prompt_tokens = server.job(body, chat)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return refuse(BadRequest("the request body is not valid JSON"))
        except BadRequest as e:
            return refuse(e)
        server.worker.jobs.put(job)
        meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", "created": int(time.time()),
                "model": server.name}
        if body.get("stream"):
            return StreamingResponse(stream(job, meta, chat, prompt_tokens, request), media_type="text/event-stream")
        texts = [""] * job.settings.num_return_sequences
        while True:
            kind, *rest = await job.events.get()
            if kind == "text":
                texts[rest[0]] += rest[1]
            elif kind == "error":
                return refuse(BadRequest(rest[0], status=500, kind="server_error"))
            else:
                break
        ctx, new = server.config.max_seq_len, rest[0]
        choices = [{"index": i, "finish_reason": finish_reason(ids, job.settings, prompt_tokens, ctx),
                    **({"message": {"role": "assistant", "content": text}} if chat else
                       {"text": text, "logprobs": None})} for i, (text, ids) in enumerate(zip(texts, new))]
        used = sum(map(len, new))
        return JSONResponse({**meta, "object": "chat.completion" if chat else "text_completion", "choices": choices,
                             "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": used,
                                       "total_tokens": prompt_tokens + used}})

    async def stream(job: Job, meta: dict, chat: bool, prompt_tokens: int, request):
        kind_name = "chat.completion.chunk" if chat else "text_completion"

        def chunk(i, text=None, finish=None, role=False):
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
                choice = {"index": i, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": i, "text": text or "", "finish_reason": finish, "logprobs": None}
            return f"data: {json.dumps({**meta, 'object': kind_name, 'choices': [choice]})}\n\n"
        try:
            if chat:
                for i in range(job.settings.num_return_sequences):
                    yield chunk(i, role=True)
            while True:
                kind, *rest = await job.events.get()
                if kind == "text":
                    yield chunk(rest[0], rest[1])
                elif kind == "error":
                    yield f"data: {json.dumps(error_body(BadRequest(rest[0], status=500, kind='server_error')))}\n\n"
                    return
                else:
                    ctx = server.config.max_seq_len
                    for i, ids in enumerate(rest[0]):
                        yield chunk(i, finish=finish_reason(ids, job.settings, prompt_tokens, ctx))
                    yield "data: [DONE]\n\n"
                    return
        finally:
            job.cancelled = True  # a client gone mid-stream frees its row at the next read; no-op when finished

    async def completions(request):
        return await complete(request, chat=False)

    async def chat_completions(request):
        return await complete(request, chat=True)

    return Starlette(routes=[Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"]),
                             Route("/v1/chat/completions", chat_completions, methods=["POST"])])


@error_contract
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", nargs="?", default="", help="checkpoint, run or Hugging Face folder (default: the default "
                                                       "run folder)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on; 0.0.0.0 opens it to the network")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api_key", default="", help="require Authorization: Bearer KEY on every request")
    p.add_argument("--name", default="", help="the model's name in the API (default: the folder's)")
    p.add_argument("--best", action="store_true", help="a run folder's best checkpoint, not its newest")
    p.add_argument("--device", default="auto")
    p.add_argument("--compile", choices=["auto", "true", "false"], default="auto",
                   help="compile the decode step (auto: on CUDA)")
    p.add_argument("--quantize", choices=["none", "int8"], default="none")
    p.add_argument("--max_batch", type=int, default=8, help="requests generated together at most")
    args = p.parse_args(argv)
    try:
        import uvicorn
    except ImportError:
        raise RunFailure("serving needs starlette and uvicorn: pip install -r requirements.txt") from None
    server = Server(args)
    print(f"serving {server.path} as {server.name!r} on http://{args.host}:{args.port}/v1", file=sys.stderr,
          flush=True)
    uvicorn.run(app_for(server), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
