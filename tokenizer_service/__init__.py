"""Tokenizer service: tokenization, chat templates and incremental detokenization.

    from tokenizer_service import ChatTokenizer, IncrementalDetokenizer, AsyncTokenizer, make_tokenizer

See tokenizer.py (the library), client.py (the async interface, in-process or over HTTP) and
service.py (the Starlette app behind ``kaiten tokenizer``).
"""
from .client import (AsyncDetokenizer, AsyncTokenizer, LocalAsyncTokenizer, RemoteAsyncTokenizer,
                     TokenizerUnavailable, make_tokenizer)
from .tokenizer import ChatTokenizer, IncrementalDetokenizer, validate_messages, validate_token_ids

__all__ = [
    "AsyncDetokenizer", "AsyncTokenizer", "ChatTokenizer", "IncrementalDetokenizer", "LocalAsyncTokenizer",
    "RemoteAsyncTokenizer", "TokenizerUnavailable", "make_tokenizer", "validate_messages", "validate_token_ids",
]
