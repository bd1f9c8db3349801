// The /docs page: Swagger UI (vendored) over this gateway's /openapi.json.
SwaggerUIBundle({ url: "/openapi.json", dom_id: "#docs", validatorUrl: null, deepLinking: true });
