"""The bounded in-memory store behind ``previous_response_id`` and ``GET /v1/responses/{id}``.

Least recently used records are evicted beyond ``max_records`` or ``max_bytes`` (the JSON size of
the stored response plus its input items). A record larger than the whole budget is not kept.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass
class StoredResponse:
    response: dict[str, Any]
    input_items: list[dict[str, Any]]  # the whole effective input (the chain included), with ids
    size: int


class ResponseStore:
    def __init__(self, max_records: int, max_bytes: int) -> None:
        self.max_records, self.max_bytes = max_records, max_bytes
        self._records: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._records)

    def put(self, response: dict[str, Any], input_items: list[dict[str, Any]]) -> bool:
        size = len(json.dumps(response)) + len(json.dumps(input_items))
        if size > self.max_bytes or self.max_records < 1:
            return False
        with self._lock:
            self._drop(response["id"])
            while self._records and (len(self._records) >= self.max_records or self._bytes + size > self.max_bytes):
                self._drop(next(iter(self._records)))
            self._records[response["id"]] = StoredResponse(response, input_items, size)
            self._bytes += size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            record = self._records.get(response_id)
            if record is not None:
                self._records.move_to_end(response_id)
            return record

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        record = self._records.pop(response_id, None)
        if record is None:
            return False
        self._bytes -= record.size
        return True
