"""A store request past its deadline names where it went: the endpoint given, or, for an `s3://`
URL with none given, that it went to AWS S3 itself and which settings would have redirected it."""

from concurrent.futures import Future

import pytest

from safe_ckpt.errors import WriteError
from safe_ckpt.sinks.tensorstore import bounded


def test_an_s3_request_without_an_endpoint_says_it_went_to_aws_and_how_to_point_it_elsewhere(monkeypatch):
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(WriteError) as caught:
        bounded(Future(), 0.01, "s3://bucket/run/iter_0000001/<listing>")
    text = str(caught.value)
    assert "no endpoint" in text and "AWS_ENDPOINT_URL_S3" in text and "AWS S3 itself" in text, text
    assert "did not answer within 0.0 s" in text, text


def test_a_request_to_a_given_endpoint_names_it(monkeypatch):
    import safe_ckpt.sinks.tensorstore as ts

    monkeypatch.setattr(ts, "unreachable", lambda endpoint: None)  # the endpoint answers, just not in time
    with pytest.raises(WriteError) as caught:
        bounded(Future(), 0.01, "s3://bucket/run/", endpoint="http://127.0.0.1:9000")
    assert "the store at http://127.0.0.1:9000 did not answer" in str(caught.value), str(caught.value)
