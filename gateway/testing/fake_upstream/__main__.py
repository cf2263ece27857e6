"""``python -m gateway.testing.fake_upstream``: serve a fake ``vllm serve`` (see ``server.main``)."""

from gateway.testing.fake_upstream.server import main

if __name__ == "__main__":
    main()
