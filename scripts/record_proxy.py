"""A recording HTTP proxy on 127.0.0.1 for scripts/agent_clients.sh.

    python scripts/record_proxy.py LISTEN_PORT UPSTREAM_PORT LOG.jsonl

Forwards every request to ``http://127.0.0.1:UPSTREAM_PORT`` unchanged and streams the answer
back chunk by chunk (server-sent events pass as they come). Each exchange is one JSON line in
LOG.jsonl: ``method``, ``path``, ``status``, the request body (parsed JSON, else its size), the
``usage`` objects the answer reported (a streamed one's events included: the prompt's cached
tokens show whether the prefix cache served the turn) and, for a 4xx/5xx, the answer's body. Only loopback is listened on and connected to.
"""
from __future__ import annotations

import http.client
import json
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LISTEN, UPSTREAM, LOG = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
_lock = threading.Lock()
_HOP = {'connection', 'keep-alive', 'transfer-encoding', 'content-length', 'host'}
_KEEP = 8 << 20         # bytes of an answer kept for the log


def _usages(answer: bytes) -> list:
    """Every ``usage`` object in a JSON answer or in the ``data:`` lines of an event stream."""
    out = []

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get('usage'), dict):
                out.append(node['usage'])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
    text = answer.decode(errors='replace')
    for doc in [text] + re.findall(r'^data: (.*)$', text, flags=re.M):
        try:
            walk(json.loads(doc))
        except ValueError:
            pass
    return out


class _Proxy(BaseHTTPRequestHandler):
    protocol_version = 'HTTP/1.1'

    def log_message(self, *args):      # the JSONL file is the log
        pass

    def _forward(self):
        body = self.rfile.read(int(self.headers.get('Content-Length') or 0))
        conn = http.client.HTTPConnection('127.0.0.1', UPSTREAM, timeout=600)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
        conn.request(self.command, self.path, body=body or None, headers=headers)
        resp = conn.getresponse()
        self.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in _HOP:
                self.send_header(k, v)
        self.send_header('Transfer-Encoding', 'chunked')
        self.send_header('Connection', 'close')
        self.end_headers()
        answer = b''
        while True:
            chunk = resp.read1(65536)
            if not chunk:
                break
            if len(answer) < _KEEP:
                answer += chunk
            self.wfile.write(b'%x\r\n%s\r\n' % (len(chunk), chunk))
            self.wfile.flush()
        self.wfile.write(b'0\r\n\r\n')
        conn.close()
        try:
            request = json.loads(body) if body else None
        except ValueError:
            request = {'bytes': len(body)}
        entry = {'method': self.command, 'path': self.path, 'status': resp.status, 'request': request,
                 'usage': _usages(answer)}
        if resp.status >= 400:
            entry['answer'] = answer.decode(errors='replace')[:2000]
        with _lock, open(LOG, 'a') as f:
            f.write(json.dumps(entry) + '\n')
        self.close_connection = True

    do_GET = do_POST = do_DELETE = do_HEAD = do_PUT = _forward


if __name__ == '__main__':
    ThreadingHTTPServer(('127.0.0.1', LISTEN), _Proxy).serve_forever()
