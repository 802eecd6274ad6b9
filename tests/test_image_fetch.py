"""Which image URLs the API server fetches: public hosts only unless told otherwise, only the
allowed host names when a list is given, redirects included, and no request is sent to a host
the policy refuses (the check runs on the address each connection reaches)."""
import http.server
import threading

import pytest

from lmdeploy.serve.images import ImageFetchLimits, _fetch, _non_public


@pytest.fixture(scope='module')
def local_http():
    """A loopback HTTP server: ``/img`` returns bytes, ``/hop`` redirects to ``127.0.0.1``'s
    ``/img``; ``hits`` counts the requests each path received."""
    hits = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            hits[self.path] = hits.get(self.path, 0) + 1
            if self.path == '/hop':
                self.send_response(302)
                self.send_header('Location', f'http://127.0.0.1:{self.server.server_address[1]}/img')
                self.send_header('Content-Length', '0')
                self.end_headers()
                return
            self.send_response(200)
            self.send_header('Content-Length', '5')
            self.end_headers()
            self.wfile.write(b'bytes')

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(('127.0.0.1', 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1], hits
    srv.shutdown()


@pytest.mark.parametrize('ip, refused', [
    ('127.0.0.1', True), ('127.8.9.10', True), ('::1', True), ('0.0.0.0', True), ('10.1.2.3', True),
    ('172.16.0.1', True), ('192.168.1.1', True), ('169.254.169.254', True), ('100.64.0.1', True),
    ('fe80::1', True), ('fe80::1%eth0', True), ('fc00::1', True), ('224.0.0.1', True), ('ff02::1', True),
    ('::ffff:127.0.0.1', True), ('::ffff:10.0.0.1', True), ('240.0.0.1', True),
    ('8.8.8.8', False), ('1.1.1.1', False), ('2001:4860:4860::8888', False), ('::ffff:8.8.8.8', False)])
def test_non_public_addresses(ip, refused):
    assert _non_public(ip) is refused


def test_loopback_is_refused_by_default_before_any_request(local_http):
    port, hits = local_http
    before = dict(hits)
    for host in ('127.0.0.1', 'localhost'):
        with pytest.raises(ValueError, match=r'part: .*loopback, private or link-local.*--allow-private-media-urls'):
            _fetch(f'http://{host}:{port}/img', ImageFetchLimits(), 'part')
    assert hits == before                     # refused once connected, before the request was sent


def test_allow_private_fetches_and_redirects_are_checked_too(local_http):
    port, hits = local_http
    assert _fetch(f'http://127.0.0.1:{port}/img', ImageFetchLimits(allow_private=True), 'part') == b'bytes'
    # an allowed name that redirects to a host outside the list: the redirect is refused
    limits = ImageFetchLimits(allow_private=True, allowed_domains=('localhost',))
    img_hits = hits.get('/img', 0)
    with pytest.raises(ValueError, match="part: image host '127.0.0.1' is not one of the allowed media domains"):
        _fetch(f'http://localhost:{port}/hop', limits, 'part')
    assert hits['/hop'] >= 1 and hits.get('/img', 0) == img_hits
    assert _fetch(f'http://localhost:{port}/img', limits, 'part') == b'bytes'


def test_a_host_outside_the_allowed_domains_is_refused_without_connecting():
    # port 9 of a documentation-only address: a connection attempt would time out, not fail fast
    with pytest.raises(ValueError, match="image host 'example.org' is not one of the allowed media domains"):
        _fetch('http://example.org:9/x.png', ImageFetchLimits(allowed_domains=('images.example.com',), timeout_s=30),
               'part')


def test_a_closed_and_an_open_private_port_get_the_same_answer(local_http):
    """The host is checked before connecting, so a client cannot tell an open port from a closed
    one (and no TLS hello reaches a private host either)."""
    port, _ = local_http
    answers = set()
    for url in (f'http://127.0.0.1:{port}/img', 'http://127.0.0.1:1/img', f'https://127.0.0.1:{port}/img',
                'https://127.0.0.1:1/img', 'http://10.255.255.1:81/img'):
        with pytest.raises(ValueError) as err:
            _fetch(url, ImageFetchLimits(timeout_s=30), 'part')
        answers.add(str(err.value))
    assert answers == {'part: image URLs may not point to loopback, private or link-local addresses (the server '
                       'allows this with --allow-private-media-urls)'}


def test_a_tls_hello_never_reaches_a_private_host():
    import socket
    with socket.socket() as listener:
        listener.bind(('127.0.0.1', 0))
        listener.listen(1)
        listener.settimeout(0.5)
        with pytest.raises(ValueError, match='loopback'):
            _fetch(f'https://127.0.0.1:{listener.getsockname()[1]}/x.png', ImageFetchLimits(), 'part')
        with pytest.raises(socket.timeout):
            listener.accept()


@pytest.mark.parametrize('url, words', [('http://user:pw@127.0.0.1:1/a.png', 'user name or password'),
                                        ('http://127.0.0.1:99999/a.png', 'invalid port')])
def test_urls_with_credentials_or_a_bad_port_are_refused_clearly(url, words):
    with pytest.raises(ValueError, match=words):
        _fetch(url, ImageFetchLimits(allow_private=True), 'part')


def test_an_ipv6_literal_can_be_an_allowed_domain():
    from lmdeploy.cli.serve import _host_name
    assert _host_name('[::1]') == _host_name('::1') == '::1'
    assert _host_name('Images.Example.COM.') == 'images.example.com'
    with pytest.raises(ValueError, match="image host 'x.org' is not one"):
        _fetch('http://x.org/a.png', ImageFetchLimits(allowed_domains=('::1',)), 'part')
    # [::1] passes the domain list and reaches the private-address rule
    with pytest.raises(ValueError, match='loopback'):
        _fetch('http://[::1]:1/a.png', ImageFetchLimits(allowed_domains=('::1',)), 'part')
