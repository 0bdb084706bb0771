"""The chat page's assets (index.html, app.js, style.css), served by api/routes_web.py."""
