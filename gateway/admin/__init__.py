"""The admin listener (``--admin-port``): what on-call engineers see and change at run time.

- ``app``: the admin Starlette app: read routes (pools, classes, overrides, audit, config, explain), token check.
- ``changes``: the routes that change routing (weights, drains, forced classes, removals, reload), each audited.
- ``openapi``: the OpenAPI 3.1 description served at ``/admin/openapi.json``; ``openapi_schemas``: its body
  schemas and error answers.
- ``explain``: what the gateway would do with one request, with the live numbers (server side).
- ``ui``: the on-call console at ``/admin/ui``: the page and its files (``static/``: plain HTML, CSS and JavaScript
  shipped as package data, no build step), served without the token because they carry no data.
- ``protocol``: names and limits shared with clients (token variable, actor header, reason length); imports nothing.
- ``client``: the HTTP client the CLI uses; imports only ``protocol``, never the server.
"""
