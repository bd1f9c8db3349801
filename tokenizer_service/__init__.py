"""Tokenizer service: tokenization, chat templates and incremental detokenization (in-process).

    from tokenizer_service import ChatTokenizer, Detokenizer, AsyncTokenizer, make_tokenizer

See tokenizer.py (the library), client.py (the async interface, in-process or over HTTP) and
service.py (the Starlette app behind ``kaiten tokenizer``).
"""
from .client import AsyncTokenizer, LocalAsyncTokenizer, RemoteAsyncTokenizer, TokenizerUnavailable, make_tokenizer
from .tokenizer import ChatTemplateOptions, ChatTokenizer, Detokenizer, validate_messages, validate_token_ids

__all__ = [
    "AsyncTokenizer", "ChatTemplateOptions", "ChatTokenizer", "Detokenizer", "LocalAsyncTokenizer",
    "RemoteAsyncTokenizer", "TokenizerUnavailable", "make_tokenizer", "validate_messages", "validate_token_ids",
]
