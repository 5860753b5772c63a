"""Serve a trained model over the OpenAI API (/v1/completions, /v1/chat/completions, streaming too,
/v1/models) and a chat page at /.

    python serve.py runs/default --port 8000                  # on 127.0.0.1; --host 0.0.0.0 to open it up
    python serve.py runs/chat --api_key secret --max_batch 16
Any OpenAI client then works:  OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="secret"); so does a
browser at http://127.0.0.1:8000/. The model loads like the REPL's (a checkpoint, run or Hugging Face folder,
hf:ORG/NAME, a .gguf; --best) and generates through the same engine. Requests that arrive together are
batched, each row with its own settings; the rest queue (the worker: llm/generate/worker.py). Completions give
echo and logprobs as evaluation harnesses read them (openai_api.py).
A bad request gets a 400 with an OpenAI-style error body naming the parameter, and the server goes on.
Limits: a request body of at most 1 MiB (MAX_BODY; 413 past it), at most 4 stop strings of at most 256
characters each, n up to 16, 64 prompts, seed and top_k up to 2**63 - 1; JSON's Infinity and NaN, and lone
surrogates ("\\ud800") in any field, are refused.
"""

import asyncio
import json
import os
import signal
import sys
import time
import uuid

# a Ctrl-C while torch imports ends quietly (status 130); error_contract then takes over
if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_DFL)

from config import LoadConfig, ServeConfig
from llm.base.cli import parse_sections
from llm.base.errors import RunFailure, error_contract
from llm.formats.checkpoint import checkpoint_step
from llm.formats.hf_hub import HF_PREFIX, is_hub_name
from llm.generate.decode_compile import compile_failed, compile_in_background, compiles, exit_process
from llm.generate.inference import load_for_inference
from llm.generate.openai_api import (MAX_BODY, BadRequest, chat_scoring_of, check_text, prompts_of,
                                     refuse_unimplemented, released, scoring_of, settings_of,
                                     stream_options_of)
from llm.generate.worker import Job, Worker
from llm.reports.monitor import read_metrics
from llm.tokens.tokenizer import can_chat, chat_prompt_ids

try:  # optional until serving: main() names what to install
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import ClientDisconnect
    from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
    from starlette.routing import Route
except ImportError:
    uvicorn = None

PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llm", "generate", "chat_page.html")
# The page's script and style are inline; it may talk to this server only, and load nothing else.
PAGE_POLICY = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src "
               "'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


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
        raise BadRequest("the request body is not valid JSON (or nests "
                         "too deeply); send a JSON object") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    check_text(body)
    return body


class Server:
    """The model, its tokenizer and the worker: what the handlers reach as request.app.state.server."""

    def __init__(self, load: LoadConfig, serving: ServeConfig):
        self.model, self.tokenizer, self.config, self.path = load_for_inference(load)
        # a Hub model by its name, not its cache
        named = load.checkpoint if is_hub_name(load.checkpoint) else self.path
        self.name, self.api_key = serving.name or model_name(named), serving.api_key
        self.about = self.facts()
        self.worker = Worker(self.model, self.tokenizer, serving.max_batch)
        self.worker.start()
        if compiles(self.model):  # the first replies are eager meanwhile
            settings = settings_of({}, self.config.max_seq_len)  # a request's defaults
            compile_in_background(self.model, settings, compile_failed)

    def job(self, body: dict, chat: bool) -> Job:
        """The request as a job for the worker, every value checked first: a bad one never joins a batch."""
        if body.get("model") not in (None, self.name):
            raise BadRequest(f"model {body.get('model')!r:.80} does not "
                             f"exist, this server has {self.name!r}", "model")
        refuse_unimplemented(body)
        if chat:
            if not can_chat(self.tokenizer):
                raise BadRequest("this model was not trained on conversations (its tokenizer has no "
                                 "<|im_start|>); use /v1/completions", "messages")
            try:
                ids = chat_prompt_ids(self.tokenizer, body.get("messages"))
            except ValueError as e:
                raise BadRequest(f"messages: {e}", "messages") from None
            prompts, scoring = [ids], chat_scoring_of(body)
        else:
            scoring = scoring_of(body)
            prompts = prompts_of(body, self.tokenizer, self.config.vocab_size)
        settings = settings_of(body, self.config.max_seq_len, chat, scoring.echo)
        generating = not (scoring.echo and body.get("max_tokens") == 0)
        ctx = self.config.max_seq_len
        # a prompt only scored may fill the context; one to continue needs room for a token
        limit = ctx - generating
        for ids in prompts:
            if not 0 < len(ids) <= limit:
                # lm-eval's default max_length (2048) overfills a shorter context, and it shows only the
                # status.
                e = BadRequest(f"a prompt has {len(ids)} tokens and the model's context is {ctx}, so a "
                               f"prompt takes 1 to {limit}; shorten it (with lm-eval, pass "
                               f"max_length={ctx} in --model_args)",
                               "messages" if chat else "prompt")
                print(f"refused a request: {e.message}", file=sys.stderr, flush=True)
                raise e
        echoed = [("".join(released(self.tokenizer, ids))) for ids in prompts] if scoring.echo else []
        return Job(prompts, settings, chat, asyncio.get_running_loop(), scoring, generating, echoed)

    def facts(self) -> dict:
        """What /v1/models tells of the model besides its name: context, whether it chats, and for a run's
        checkpoint its step and that step's validation bits per byte (the run's last evaluation at or before
        it; None where there is none)."""
        facts = {"max_model_len": self.config.max_seq_len, "chat": can_chat(self.tokenizer), "step": None,
                 "val_bpb": None}
        run, folder = os.path.split(os.path.dirname(os.path.normpath(self.path)))
        if folder == "checkpoints":
            try:
                facts["step"] = step = checkpoint_step(self.path)
            except AttributeError:  # a folder not named step_N
                return facts
            evals = [r for r in read_metrics(run, "eval") if r.get("step", step + 1) <= step]
            bpb = evals[-1].get("val_bpb") if evals else None
            facts["val_bpb"] = bpb if isinstance(bpb, (int, float)) else None
        return facts


def model_name(path: str) -> str:
    """A model's name in the API: its run folder's for a checkpoint (runs/mine/checkpoints/step_N: mine),
    ORG/NAME for hf:ORG/NAME, else its folder's."""
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
                                                     "owned_by": "modern-llm", **server.about}]})


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
        usage = stream_options_of(body)
        job = server.job(body, chat)
    except BadRequest as e:
        return refuse(e)
    server.worker.jobs.put(job)
    meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", "created": int(time.time()),
            "model": server.name}
    if body.get("stream"):
        return StreamingResponse(streamed(job, meta, chat, usage), media_type="text/event-stream")
    return await unless_gone(request, job, whole(job, meta, chat))


async def unless_gone(request, job: Job, answer):
    """The answer, unless the client leaves first: then its rows stop at the engine's next read, as a stream's
    do (ten abandoned requests of 16 choices once held the next request 15 s)."""
    answering, gone = asyncio.ensure_future(answer), asyncio.ensure_future(disconnected(request))
    done, _ = await asyncio.wait({answering, gone}, return_when=asyncio.FIRST_COMPLETED)
    if answering in done:
        gone.cancel()
        return answering.result()
    job.cancelled = True
    answering.cancel()
    return Response(status_code=499)  # nobody reads it


async def disconnected(request):
    """Returns when the client has closed the connection (the body is read: the next message is that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def whole(job: Job, meta: dict, chat: bool):
    """The answer in one JSON object, once every choice has ended."""
    n, per = job.choices, job.settings.num_return_sequences
    # with echo, each starts with its prompt
    texts = [job.echoed[c // per] if job.echoed else "" for c in range(n)]
    reasons, logprobs, used = [None] * n, [None] * n, 0
    async for event in job.stream():
        if event.error:
            return refuse(event.error)
        texts[event.choice] += event.text
        reasons[event.choice] = event.finish_reason or reasons[event.choice]
        logprobs[event.choice] = event.logprobs or logprobs[event.choice]
        used += event.tokens
    choices = [{"index": i, "finish_reason": reasons[i], "logprobs": logprobs[i],
                **({"message": {"role": "assistant", "content": text}} if chat else {"text": text})}
               for i, text in enumerate(texts)]
    return JSONResponse({**meta, "object": "chat.completion" if chat else "text_completion",
                         "choices": choices, "usage": usage_of(job, used)})


def usage_of(job: Job, completion_tokens: int) -> dict:
    prompt_tokens = sum(map(len, job.prompts))
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def streamed(job: Job, meta: dict, chat: bool, usage: bool = False):
    """The answer as server-sent events, a chunk per piece of text and one per choice's end, then (with
    stream_options.include_usage) a chunk of no choices holding the usage, then [DONE]."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    last = {"usage": None} if usage else {}  # OpenAI's chunks carry usage: null until the last one

    def chunk(i, text=None, finish=None, role=False):
        if chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": i, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": i, "text": text or "", "finish_reason": finish, "logprobs": None}
        return f"data: {json.dumps({**meta, 'object': kind, 'choices': [choice], **last})}\n\n"
    try:
        if chat:
            for i in range(job.choices):
                yield chunk(i, role=True)
        used = 0
        async for event in job.stream():
            if event.error:
                yield f"data: {json.dumps(error_body(event.error))}\n\n"
                return
            if event.text:
                yield chunk(event.choice, event.text)
            if event.finish_reason:
                used += event.tokens
                yield chunk(event.choice, finish=event.finish_reason)
        if usage:
            yield ("data: "
                   f"{json.dumps({**meta, 'object': kind, 'choices': [], 'usage': usage_of(job, used)})}\n\n")
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled = True  # a client gone mid-stream frees its row at the next read; no-op when finished


async def page(request):
    """The chat page: static, no secret in it; what it shows comes from the API, with the key typed into it.
    """
    return HTMLResponse(request.app.state.page, headers={"Content-Security-Policy": PAGE_POLICY,
                                                         "Cache-Control": "no-store"})


def app_for(server: Server):
    """The Starlette application: the routes, with the server and the chat page in app.state."""
    app = Starlette(routes=[Route("/", page), Route("/v1/models", models),
                            Route("/v1/completions", completions, methods=["POST"]),
                            Route("/v1/chat/completions", chat_completions, methods=["POST"])])
    app.state.server = server
    with open(PAGE, encoding="utf-8") as f:
        app.state.page = f.read()
    return app


def parse_args(argv=None) -> tuple[LoadConfig, ServeConfig]:
    """The command line, every flag a field of LoadConfig or ServeConfig; tests build their in-process servers
    from it too."""
    (load, serving), _ = parse_sections((LoadConfig, ServeConfig), (LoadConfig(), ServeConfig()),
                                        sys.argv[1:] if argv is None else argv,
                                        "Serve a model over the OpenAI API, with a chat page at /. Every "
                                        "field below can be set as --name value.")
    return load, serving


@error_contract
def main(argv=None) -> int:
    load, serving = parse_args(argv)
    if uvicorn is None:
        raise RunFailure("serving needs starlette and uvicorn: pip install -r requirements.txt")
    server = Server(load, serving)
    print(f"serving {server.path} as {server.name!r} on http://{serving.host}:{serving.port}/v1, a chat page "
          f"at http://{serving.host}:{serving.port}/", file=sys.stderr, flush=True)
    uvicorn.run(app_for(server), host=serving.host, port=serving.port, log_level="warning")
    return 0


if __name__ == "__main__":
    exit_process(main())  # not sys.exit: a background compile may still be running
