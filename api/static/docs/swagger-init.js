// Swagger UI on /docs, from the vendored bundle (no CDN, no inline script: the page's CSP
// allows scripts from this server only).
window.ui = SwaggerUIBundle({
  url: "/openapi.json",
  dom_id: "#swagger-ui",
  layout: "BaseLayout",
  deepLinking: true,
  showExtensions: true,
  showCommonExtensions: true,
  presets: [SwaggerUIBundle.presets.apis],
});
