"""llama.cpp's side of ``bench/peers/export.py``, run with ``bench/.llama-venv/bin/python`` (built by
``bench/peers/setup_llama_cpp.sh``): it imports nothing of the project.

    _llama_side.py FILE.gguf REQUEST.json  ->  one JSON object on stdout

REQUEST holds ``chats`` (lists of turns), ``max_new_tokens``, ``stop_ids`` and ``threads``.
For each chat, llama.cpp renders it with the chat template stored in the file (llama-cpp-python's
Jinja2 formatter, as its chat completion does), tokenizes the text with the file's vocabulary
(special tokens parsed, BOS as the file says), and continues it greedily (top-k 1, no repeat
penalty) until a stop id or ``max_new_tokens``. Returns the load time, each chat's prompt ids
and continuation, and the generation speed.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    from llama_cpp import Llama, __version__
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    path, request_file = sys.argv[1], sys.argv[2]
    with open(request_file, encoding="utf-8") as handle:
        request = json.load(handle)
    started = time.perf_counter()
    llm = Llama(model_path=path, n_ctx=2048, n_threads=request["threads"], verbose=False)
    load_s = time.perf_counter() - started
    metadata = llm.metadata
    template = metadata.get("tokenizer.chat_template")
    if not template:
        raise SystemExit(f"{path} holds no chat template (tokenizer.chat_template)")
    formatter = Jinja2ChatFormatter(
        template=template,
        eos_token=llm.detokenize([llm.token_eos()], special=True).decode(),
        bos_token=llm.detokenize([llm.token_bos()], special=True).decode(),
    )
    stops = set(request["stop_ids"])
    chats, generated, generating_s = [], 0, 0.0
    for chat in request["chats"]:
        # as llama-cpp-python's chat completion does: a Jinja template writes its own special
        # tokens (added_special), so no BOS is added to what it renders
        rendered = formatter(messages=chat)
        ids = llm.tokenize(
            rendered.prompt.encode("utf-8"), add_bos=not rendered.added_special, special=True
        )
        out: list[int] = []
        started = time.perf_counter()
        for token in llm.generate(
            ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True
        ):
            out.append(int(token))
            if int(token) in stops or len(out) == request["max_new_tokens"]:
                break
        generating_s += time.perf_counter() - started
        generated += len(out)
        chats.append({"prompt_ids": ids, "greedy": out})
    json.dump(
        {
            "llama_cpp_python": __version__,
            "load_s": load_s,
            "chats": chats,
            "tokens_per_s": generated / generating_s if generating_s else None,
        },
        sys.stdout,
    )


if __name__ == "__main__":
    main()
