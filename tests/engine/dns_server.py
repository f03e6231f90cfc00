"""A tiny authoritative DNS server for tests: answers A queries for names the test sets, NXDOMAIN otherwise.

Built on dnspython's message codec (the library discovery itself uses); UDP only, on 127.0.0.1, in a thread.
"""

from __future__ import annotations

import socket
import threading

import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset


class TestDNSServer:
    __test__ = False  # not a pytest test class

    def __init__(self, host: str = "127.0.0.1", ttl: int = 0) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind((host, 0))
        self._sock.settimeout(0.2)
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self._ttl = ttl
        self._records: dict[str, list[str]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="test-dns", daemon=True)
        self.queries = 0

    def set(self, name: str, addresses: list[str]) -> None:
        """Answer ``name`` with these A records from now on (an empty list: NXDOMAIN, like a Service with no
        ready endpoints)."""
        with self._lock:
            self._records[name.rstrip(".").lower()] = list(addresses)

    def start(self) -> TestDNSServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                wire, peer = self._sock.recvfrom(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                query = dns.message.from_wire(wire)
            except dns.exception.DNSException:
                continue
            self.queries += 1
            self._sock.sendto(self._answer(query).to_wire(), peer)

    def _answer(self, query: dns.message.Message) -> dns.message.Message:
        response = dns.message.make_response(query)
        question = query.question[0]
        with self._lock:
            addresses = self._records.get(question.name.to_text().rstrip(".").lower())
        if not addresses:
            response.set_rcode(dns.rcode.NXDOMAIN)
        elif question.rdtype == dns.rdatatype.A:
            response.answer.append(dns.rrset.from_text_list(question.name, self._ttl, "IN", "A", addresses))
        return response
