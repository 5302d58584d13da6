"""A moto S3 server on loopback for the tests: one per test module, started by a fixture.

``moto_s3(objects)`` starts moto's S3-compatible server on ``127.0.0.1`` at an ephemeral port,
fills buckets with ``objects`` (``{bucket: {key: body}}``), yields the endpoint URL, and stops
the server, closing its listening socket, at the end. The server runs in this process: the
buckets are made through it, and the objects are put into its store directly (a thousand
``PutObject`` requests took 6 s, most of a module's time; the tests read them through the
server, as a client would).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import botocore.session
from moto.core.models import DEFAULT_ACCOUNT_ID
from moto.s3.models import s3_backends
from moto.server import ThreadedMotoServer


def s3_options(endpoint: str, **extra: Any) -> dict[str, Any]:
    """s3fs storage options for the server at ``endpoint``."""
    return {
        "key": "testing",
        "secret": "testing",
        "endpoint_url": endpoint,
        "client_kwargs": {"region_name": "us-east-1"},
        **extra,
    }


@contextlib.contextmanager
def moto_s3(objects: Mapping[str, Mapping[str, bytes]]) -> Iterator[str]:
    """The server's endpoint, with ``objects`` in it (see the module docstring)."""
    quiet = logging.getLogger("werkzeug")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # one access-log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        client = botocore.session.get_session().create_client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        try:
            for bucket in objects:
                client.create_bucket(Bucket=bucket)
        finally:
            client.close()
        store = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]  # the server's own, in this process
        for bucket, keys in objects.items():
            for key, body in keys.items():
                store.put_object(bucket, key, body)
        yield endpoint
    finally:
        server.stop()  # shuts serve_forever down and joins its thread
        wsgi = server._server
        if wsgi is not None:
            wsgi.server_close()  # stop() leaves the listening socket open
        quiet.setLevel(level)
