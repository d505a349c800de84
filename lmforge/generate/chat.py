"""`lmforge chat`: a conversation with a model, on the model's own chat template, with one KV cache
kept across turns.

Each turn renders the whole conversation with the template (data/special_tokens.py), as a
transformers chat loop that calls apply_chat_template every turn does, and encodes it. The cache
holds the conversation's tokens so far, the prompt and the reply as they were sampled; only the
tokens after the longest prefix they share with the newly encoded conversation are run through
the model (the new turn, and any tail of the reply that encodes differently from how it was
sampled). So the reply is the model's continuation of exactly the text transformers would
compute it on, at the cost of the new turn's tokens. A model without a template (one lmforge
trained) is asked in lmforge's plain one (data/sft.py's headers), as it was fine-tuned.
"""

import os
import sys

import torch

from lmforge.data.sft import chat_header
from lmforge.data.special_tokens import SpecialTokens, encode_plain
from lmforge.generate.sampling import KVCache, generate
from lmforge.model.transformer import Transformer


def sampling_options(special: SpecialTokens, temperature: float | None, top_k: int | None,
                     top_p: float | None) -> dict:
    """temperature, top_k and top_p as given, else the model's own (generation_config.json; greedy
    where it says do_sample false), else lmforge generate's defaults (0.8, none, 0.95)."""
    defaults = special.generation_defaults
    greedy = defaults.get("do_sample") is False
    return {"temperature": temperature if temperature is not None
            else 0.0 if greedy else defaults.get("temperature", 0.8),
            "top_k": top_k if top_k is not None else defaults.get("top_k"),
            "top_p": top_p if top_p is not None else defaults.get("top_p", 0.95)}


class ChatSession:
    """One conversation: its messages, its tokens and the KV cache holding them. `sampling`:
    generate()'s temperature, top_k, top_p. `constrained`: a structured/constrain.py JsonMode, to
    answer every turn in JSON."""

    def __init__(self, model: Transformer, tokenizer, special: SpecialTokens, max_new_tokens: int,
                 system: str | None = None, constrained=None, seed: int = 0, **sampling):
        self.model, self.tokenizer, self.special = model, tokenizer, special
        self.max_new_tokens, self.system, self.constrained, self.seed = max_new_tokens, system, constrained, seed
        self.sampling = sampling
        self.cache = KVCache.for_model(model, max_new_tokens)  # grown as the conversation grows
        self.reset()

    def reset(self) -> None:
        """Forget the conversation (the cache is overwritten from the start)."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.tokens: list[int] = []  # the conversation as the cache holds it: the last prompt and reply
        self.prompt: list[int] = []
        self.cache.start = self.cache.length = 0
        self.turns = 0

    def prompt_ids(self) -> list[int]:
        """The conversation's token ids, ending with the template's generation prompt."""
        if self.special.chat_template is not None:
            return encode_plain(self.tokenizer, self.special.render_chat(self.messages, add_generation_prompt=True))
        ids = list(self.special.bos_ids)
        for message in self.messages:
            ids += encode_plain(self.tokenizer, chat_header(message["role"]))
            ids += encode_plain(self.tokenizer, message["content"] + "\n")
        return ids + encode_plain(self.tokenizer, chat_header("assistant"))

    def reply(self, text: str, on_text=None) -> str:
        """The model's answer to the user's `text`, streamed to `on_text` piece by piece as sampled."""
        self.messages.append({"role": "user", "content": text})
        target = self.prompt_ids()
        # keep what the cache holds of the shared prefix (a window moved past the start: recompute);
        # at least the last token is run, for the next token's logits
        usable = min(len(os.path.commonprefix([self.tokens, target])), self.cache.length, len(target) - 1)
        usable = usable if self.cache.start == 0 else 0
        reply: list[int] = []
        shown = ""

        def stream(token: int) -> None:
            nonlocal shown
            reply.append(token)
            decoded = self.tokenizer.decode(reply)
            if on_text is not None and not decoded.endswith("\ufffd"):  # a character cut between tokens
                on_text(decoded[len(shown):])
                shown = decoded

        options = dict(self.sampling, seed=self.seed + self.turns, cache=self.cache, cached=usable, on_token=stream)
        complete = True
        if self.constrained is None:
            generate(self.model, target, self.max_new_tokens, stop_token=self.special.stop_ids, **options)
        else:
            complete = self.constrained.generate(self.model, target, self.max_new_tokens, **options).complete
        answer = self.tokenizer.decode(reply)
        if on_text is not None and answer != shown:
            on_text(answer[len(shown):])
        self.messages.append({"role": "assistant", "content": answer})
        self.prompt, self.tokens, self.turns = target, target + reply, self.turns + 1
        self.complete = complete
        return answer


def run_chat(session: ChatSession, name: str, out=sys.stdout, read=input) -> int:
    """The interactive loop: a line from the user, the reply streamed; /reset and /exit."""
    template = "its chat template" if session.special.chat_template else "lmforge's plain chat template"
    print(f"chat with {name} ({template}); /reset starts over, /exit ends", file=out, flush=True)
    positions, told = session.model.cfg.max_seq_len, False  # said once a conversation: its start is out of view
    while True:
        try:
            line = read("> ")
        except EOFError:
            print(file=out)
            return 0
        command = line.strip()
        if command == "/exit":
            return 0
        if command == "/reset":
            session.reset()
            print("(new conversation)", file=out, flush=True)
            told = False
            continue
        if command.startswith("/"):
            print(f"unknown command {command}: /reset starts over, /exit ends", file=out, flush=True)
            continue
        if not command:
            continue
        with torch.no_grad():
            session.reply(line, on_text=lambda piece: (out.write(piece), out.flush()))
        print(file=out, flush=True)
        if not session.complete:
            print(f"(the answer was cut at --max-new-tokens {session.max_new_tokens} before its JSON closed)",
                  file=out, flush=True)
        if len(session.tokens) > positions and not told:  # generate() slid its window: the start is gone
            print(f"(the conversation is past the model's {positions:,} positions: it reads the latest ones only; "
                  f"/reset starts over)", file=out, flush=True)
            told = True
