// fedsched console: refresh the parts of a page that say so, in place.
// An element with data-refresh-url and data-refresh-s (> 0) is replaced by what that URL
// answers (an HTML fragment of the same page) every data-refresh-s seconds, while the tab is
// visible. A failed refresh keeps the old content and marks the element stale; the next
// successful one clears the mark. No framework, no network beyond this site.
(function () {
  "use strict";

  function refresh(el) {
    var url = el.getAttribute("data-refresh-url");
    if (document.hidden) { return Promise.resolve(); }
    return fetch(url, { credentials: "same-origin", headers: { "Accept": "text/html" } })
      .then(function (response) {
        if (response.redirected || !response.ok) { throw new Error("HTTP " + response.status); }
        return response.text();
      })
      .then(function (html) {
        el.innerHTML = html;
        el.classList.remove("stale");
        el.setAttribute("data-refreshed", String(Date.now()));
        el.dispatchEvent(new CustomEvent("fedsched:refreshed", { bubbles: true }));
      })
      .catch(function () { el.classList.add("stale"); });
  }

  function start() {
    var els = document.querySelectorAll("[data-refresh-url]");
    Array.prototype.forEach.call(els, function (el) {
      var seconds = parseFloat(el.getAttribute("data-refresh-s") || "0");
      if (!(seconds > 0)) { return; }
      window.setInterval(function () { refresh(el); }, seconds * 1000);
    });
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", start);
  } else {
    start();
  }
})();
