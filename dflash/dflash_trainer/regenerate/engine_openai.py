"""Engine `openai`: any OpenAI-compatible server (vLLM, SGLang, TGI, `transformers serve`) with N requests
in flight.

The server runs in its own container or environment, never in the frozen training environment (README
"DFlash recipe end to end"). Requests go to /v1/chat/completions with the conversation and the row's
`tools`, so the server renders the prompt with its own copy of the chat template; an answer the server
parsed a tool call out of is refused (its text is no longer what the target generated). `check` asks the
server once whether it returns the generated token ids (`return_token_ids`, vLLM): when it does, every
request asks for them and the rows keep exactly the tokens it generated; a server that refuses the field
(transformers serve answers 422 to fields it does not know) or ignores it gets requests without it, and
the answers' text is re-tokenized (said once at the start; each row records which in regen.answer_ids).
Requests go through urllib3 (a pool of keep-alive connections, one per request in flight) and its Retry policy:
connection errors, timeouts and 408/429/5xx are retried with exponential backoff and random jitter (so requests
that failed together do not come back together), and a 429 / 503 with Retry-After waits as long as the server
says (`retry_policy`).
"""

from __future__ import annotations

import json
import sys
import time
import urllib.parse
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import urllib3
from urllib3.util import Retry

from .answers import Answer, Request, answer_from_text
from .sampling import Sampling

RETRY_STATUS = {408, 429, 500, 502, 503, 504}


class EndpointError(RuntimeError):
    """The server cannot be used: unreachable after the retries, refusing the request, or not serving --model."""


class Refused(EndpointError):
    """The server answered the request with an HTTP error that a retry does not change (4xx but 408 / 429)."""

    def __init__(self, message: str, status: int, detail: str):
        super().__init__(message)
        self.status = status
        self.detail = detail


TOKEN_IDS = "return_token_ids"  # vLLM: choices[0].token_ids (the generated ids) and prompt_token_ids
# What makes a server render a row's tools and still return the generated text as it is
TOOL_CHOICE_FIX = ("pass --extra-body '{\"tool_choice\": \"none\"}' (vLLM 0.10 and later still render the tools into "
                   "the prompt then, and parse no tool call out of the answer; 0.9 needs "
                   "--expand-tools-even-if-tool-choice-none), or serve the target without a tool-call parser")


def wire_messages(messages: list[dict]) -> list[dict]:
    """The messages as the chat-completions API takes them: a tool call's arguments as JSON text (rows of
    LLaMA-Factory's ShareGPT carry an object; servers parse the text back into the object templates read)."""
    def call(c: dict) -> dict:
        f = c.get("function")
        if not isinstance(f, dict) or isinstance(f.get("arguments"), str) or "arguments" not in f:
            return c
        return {**c, "function": {**f, "arguments": json.dumps(f["arguments"], ensure_ascii=False)}}

    return [{**m, "tool_calls": [call(c) for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]


def retry_policy(retries: int, backoff: float) -> Retry:
    """`retries` more attempts of a request (POSTs too: a chat completion changes nothing on the server) after a
    connection error, a timeout, or a status in RETRY_STATUS. Waits: what a 429 / 503's Retry-After says, else
    urllib3's backoff (none before the first retry, then backoff x 2, x 4, ...; at most 120 s) plus up to
    `backoff` s of jitter. After the last, the last status comes back (raise_on_status False) to be named."""
    return Retry(total=retries, connect=retries, read=retries, status=retries, other=retries, redirect=0,
                 allowed_methods=None, status_forcelist=sorted(RETRY_STATUS), backoff_factor=backoff,
                 backoff_jitter=backoff, respect_retry_after_header=True, raise_on_status=False,
                 raise_on_redirect=False)


def _cause(exc: BaseException) -> str:
    """The innermost cause of a urllib3 error (ConnectionRefusedError, a read timeout), as the message names it."""
    while isinstance(exc, urllib3.exceptions.MaxRetryError) and exc.reason is not None:
        exc = exc.reason
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return f"{type(exc).__name__}: {exc}"


def base_url(endpoint: str) -> str:
    """http://host:port or http://host:port/v1 -> http://host:port/v1 (no trailing slash)."""
    parsed = urllib.parse.urlparse(endpoint if "://" in endpoint else f"http://{endpoint}")
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise EndpointError(f"--endpoint {endpoint!r} is not an http(s) URL; give e.g. http://localhost:8000/v1")
    path = parsed.path.rstrip("/") or "/v1"
    return urllib.parse.urlunparse(parsed._replace(path=path, query="", fragment=""))


class OpenAIEngine:
    name = "openai"

    def __init__(self, endpoint: str, model: str | None, tokenizer, sampling: Sampling, stop_ids: list[int],
                 concurrency: int = 64, timeout: float = 600.0, retries: int = 5, backoff: float = 1.0,
                 api_key: str | None = None, extra_body: dict | None = None, chat_template_kwargs: dict | None = None,
                 stop_tokens: list[str] | None = None):
        if sampling.ignore_eos:
            raise EndpointError("ignore_eos is not an OpenAI request field; it is for the hf engine's benchmark")
        self.url = base_url(endpoint)
        self.model = model
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.stop_ids = stop_ids
        self.concurrency = concurrency
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        # One keep-alive connection per request in flight; the timeout is per connect and per read
        self.http = urllib3.PoolManager(num_pools=4, maxsize=concurrency, retries=retry_policy(retries, backoff),
                                        timeout=urllib3.Timeout(connect=timeout, read=timeout))
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.extra_body = extra_body or {}
        self.chat_template_kwargs = chat_template_kwargs or {}
        self.stop_tokens = list(stop_tokens or [])  # --stop-token: sent as the request's `stop`
        # Ask for the generated ids: decided by check() (probe_token_ids), or by --extra-body when it names the field
        self.token_ids = bool(self.extra_body.get(TOKEN_IDS)) if TOKEN_IDS in self.extra_body else None

    # -- HTTP ------------------------------------------------------------------------------------
    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        """One JSON call, retried as retry_policy says; Refused for an HTTP error a retry does not change,
        EndpointError once the retries are spent."""
        url = self.url + path
        data = None if body is None else json.dumps(body).encode()
        started = time.monotonic()
        try:
            response = self.http.request(method, url, body=data, headers=self.headers)
        except urllib3.exceptions.HTTPError as exc:  # MaxRetryError: connection refused, timeouts, resets
            raise self._unanswered(url, started, _cause(exc)) from None
        detail = response.data.decode(errors="replace")[:500]
        if response.status in RETRY_STATUS:  # still, after the last retry
            raise self._unanswered(url, started, f"HTTP {response.status}: {detail}")
        if response.status >= 400:
            raise Refused(f"{url} refused the request: HTTP {response.status}: {detail}", response.status, detail)
        try:
            return json.loads(response.data)
        except ValueError as exc:
            raise EndpointError(f"{url} did not answer with JSON ({exc}); is --endpoint an OpenAI-compatible "
                                "server's base URL (e.g. http://host:8000/v1)?") from None

    def _unanswered(self, url: str, started: float, last: str) -> EndpointError:
        return EndpointError(
            f"{url} did not answer after {self.retries + 1} attempts over {time.monotonic() - started:.0f} s "
            f"(last: {last}). Check that the server is running and reachable at --endpoint, or raise "
            "--request-timeout / --retries; the shards already written are kept, run the same command to resume")

    def check(self) -> str:
        """The model to request: --model when the server lists it, else its only model; errors name the choices."""
        listed = self._call("GET", "/models")
        served = [m.get("id") for m in listed.get("data", []) if isinstance(m, dict)]
        if self.model is None:
            if len(served) != 1:
                raise EndpointError(f"{self.url} serves {served or 'no models'}: pick one with --model")
            self.model = served[0]
        elif self.model not in served:
            raise EndpointError(f"{self.url} does not serve --model {self.model!r}; it serves {served}. Pass one of "
                                "those, or start the server with that model")
        return self.model

    def probe_token_ids(self) -> str | None:
        """Whether requests ask for the generated token ids: one request of one token with `return_token_ids`.
        None when they do (the server sent choices[0].token_ids) or --extra-body decided; otherwise why not
        (the answers' text is then re-tokenized)."""
        if self.token_ids is not None:
            return None if self.token_ids else f"--extra-body sets {TOKEN_IDS} false"
        body = {"model": self.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                "temperature": 0.0, "stream": False, TOKEN_IDS: True}
        try:
            got = self._call("POST", "/chat/completions", body)
        except Refused as exc:
            if exc.status not in (400, 422):  # not about the field: authentication, no such endpoint, ...
                raise
            self.token_ids = False
            return f"it refuses {TOKEN_IDS} (HTTP {exc.status}: {' '.join(exc.detail.split())[:200]})"
        choices = got.get("choices") if isinstance(got, dict) else None
        choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
        self.token_ids = isinstance(choice.get("token_ids"), list)
        return None if self.token_ids else f"it ignores {TOKEN_IDS} (no choices[0].token_ids in its answer)"

    # -- answers ---------------------------------------------------------------------------------
    def request_body(self, request: Request) -> dict:
        s = self.sampling
        body = {"model": self.model, "messages": wire_messages(request.messages), "max_tokens": s.max_new_tokens,
                "temperature": s.temperature, "stream": False}
        if request.tools:  # the server renders them into the prompt, as the local prompt has them
            body["tools"] = request.tools
        if not s.greedy:
            body["seed"] = request.seed
            if s.top_p < 1:
                body["top_p"] = s.top_p
        if self.stop_tokens:
            body["stop"] = list(self.stop_tokens)
        if self.chat_template_kwargs:
            body["chat_template_kwargs"] = self.chat_template_kwargs
        if self.token_ids:
            body[TOKEN_IDS] = True
        return {**body, **self.extra_body}

    def answer_one(self, request: Request) -> Answer:
        try:
            got = self._call("POST", "/chat/completions", self.request_body(request))
        except Refused as exc:
            # Only a refusal about tools gets the tool fix (not, say, a prompt past the context)
            if not request.tools or "tool_choice" in self.extra_body or "tool" not in f"{exc} {exc.detail}".lower():
                raise
            raise Refused(f"{exc}. The request carried the row's tools: {TOOL_CHOICE_FIX}", exc.status,
                          exc.detail) from None
        try:
            choice = got["choices"][0]
            text = choice["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            raise EndpointError(f"{self.url}/chat/completions answered without choices[0].message.content: "
                                f"{json.dumps(got)[:300]}") from None
        if choice["message"].get("tool_calls"):  # the text the target generated is no longer all in `content`
            raise EndpointError(f"{self.url} parsed a tool call out of an answer (message.tool_calls), so its text "
                                f"is not what the target generated: {TOOL_CHOICE_FIX}; the shards already written "
                                "are kept, run the same command to resume")
        server_ids = choice.get("token_ids")
        prompt_ids = got.get("prompt_token_ids") or choice.get("prompt_token_ids")
        matches = prompt_ids is None or list(prompt_ids) == list(request.prompt)
        usage = got.get("usage") or {}
        return answer_from_text(self.tokenizer, text, choice.get("finish_reason"), self.stop_ids,
                                server_ids if isinstance(server_ids, list) else None, matches,
                                usage.get("completion_tokens"), choice.get("stop_reason"))

    def answer(self, requests: list[Request], should_stop: Callable[[], bool] | None = None
               ) -> Iterator[tuple[Request, Answer]]:
        """Answers as they complete, `concurrency` requests in flight; the first failure cancels the rest. Once
        `should_stop()` is true no request is sent, and those in flight are finished (a request cannot be
        called back; its answer is kept)."""
        pool = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="regen-http")
        pending = {}
        todo = iter(requests)
        stopping = False
        try:
            for request in todo:
                pending[pool.submit(self.answer_one, request)] = request
                if len(pending) >= self.concurrency:
                    break
            while pending:
                done, _ = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
                if not stopping and should_stop is not None and should_stop():
                    stopping = True
                    print(f"stopping: finishing the {len(pending)} requests in flight, sending no more",
                          file=sys.stderr, flush=True)
                for future in done:
                    request = pending.pop(future)
                    yield request, future.result()
                    nxt = None if stopping else next(todo, None)
                    if nxt is not None:
                        pending[pool.submit(self.answer_one, nxt)] = nxt
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
