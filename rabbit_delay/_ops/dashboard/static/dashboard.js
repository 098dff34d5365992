// rabbit-delay dashboard: refreshes the overview from /api/snapshot, shows parked
// messages in full on demand, and sends the actions (POST, with the per-run token).
// No library, nothing loaded from elsewhere: the server renders the page, this only
// updates the figures in it (elements marked data-q / data-f).
"use strict";

(function () {
  function meta(name) {
    var el = document.querySelector('meta[name="' + name + '"]');
    return el ? el.getAttribute("content") : null;
  }
  var token = meta("rd-token");
  var refresh = parseFloat(meta("rd-refresh") || "5");
  var pageName = meta("rd-page");

  function setText(el, text) {
    if (el && el.textContent !== text) el.textContent = text;
  }
  function n(value) {
    return value === null || value === undefined ? "?" : String(value);
  }
  function depth(node) {
    if (node.role === "plugin") return n(node.ready) + " delayed";
    var parts = ["ready " + n(node.ready)];
    if (node.unacked) parts.push("unacked " + node.unacked);
    parts.push("consumers " + n(node.consumers));
    return parts.join(" · ");
  }
  function byQueue(name) {
    return document.querySelectorAll('[data-q="' + CSS.escape(name) + '"]');
  }
  function bound(le) {
    return le === "+Inf" ? "+Inf" : String(le);
  }

  function applySnapshot(snap) {
    document.body.setAttribute("data-read-at", String(snap.read_at_ms));
    var error = document.querySelector('[data-f="error"]');
    if (error) {
      error.hidden = !snap.error;
      setText(error, snap.error || "");
    }
    setText(document.querySelector('[data-f="age"]'), snap.age_s === null ? "?" : snap.age_s.toFixed(1));
    setText(document.querySelector('[data-f="took"]'), String(Math.round(snap.read_took_s * 1000)));
    if (snap.read_at_ms) {
      setText(document.querySelector('[data-f="read-at"]'), new Date(snap.read_at_ms).toISOString());
    }
    var status = snap.status;
    if (!status) return;
    status.queues.forEach(function (row) {
      byQueue(row.name).forEach(function (el) {
        el.classList.toggle("attention", row.attention);
        setText(el.querySelector('[data-f="ready"]'), n(row.ready));
        setText(el.querySelector('[data-f="unacked"]'), n(row.unacked));
        setText(el.querySelector('[data-f="consumers"]'), n(row.consumers));
        setText(el.querySelector('[data-f="notes"]'), row.notes.join("; "));
        var oldest = el.querySelector('[data-f="oldest"]');
        if (oldest) {
          var empty = row.role.indexOf("buffer") < 0 && row.role.indexOf("cascade") < 0;
          setText(oldest, empty || !row.exists || !row.ready ? "" : (row.oldest_age || "?"));
        }
      });
    });
    snap.picture.forEach(function (node) {
      byQueue(node.key).forEach(function (el) {
        el.classList.toggle("attention", node.attention);
        setText(el.querySelector('[data-f="depth"]'), depth(node));
        setText(el.querySelector('[data-f="mark"]'), node.attention ? "!" : "");
      });
    });
    var list = document.querySelector('[data-f="attention"]');
    if (list) {
      while (list.firstChild) list.removeChild(list.firstChild);
      status.attention_items.forEach(function (item) {
        var li = document.createElement("li");
        var b = document.createElement("b");
        b.textContent = item.subject;
        li.appendChild(b);
        li.appendChild(document.createTextNode(": " + item.hint));
        list.appendChild(li);
      });
      var ok = document.querySelector('[data-f="all-ok"]');
      if (ok) ok.hidden = status.attention_items.length > 0;
    }
    applyLateness(snap.lateness);
  }

  function applyLateness(series) {
    var box = document.querySelector(".histograms");
    if (!box) return;
    var keys = series.map(function (h) { return h.queue + "|" + h.tier; }).join(",");
    if (keys !== (box.getAttribute("data-keys") || "")) {
      window.location.reload(); // new series: the server draws them
      return;
    }
    series.forEach(function (h, i) {
      var svg = box.querySelector('[data-h="' + i + '"]');
      if (!svg) return;
      var top = Math.max.apply(null, h.buckets.map(function (b) { return b.count; })) || 1;
      h.buckets.forEach(function (b, j) {
        var rect = svg.querySelector('[data-b="' + j + '"]');
        var label = svg.querySelector('[data-c="' + j + '"]');
        if (!rect) return;
        var tall = Math.round(90 * b.count / top);
        rect.setAttribute("y", String(110 - tall));
        rect.setAttribute("height", String(tall));
        if (label) {
          label.setAttribute("y", String(110 - tall - 3));
          setText(label, b.count ? String(b.count) : "");
        }
      });
      var caption = box.querySelector('[data-hc="' + i + '"]');
      if (caption) {
        setText(caption, h.count ? h.count + " deliveries, mean " + h.mean_s.toFixed(3) +
          " s, p50 ≤ " + bound(h.p50_le_s) + " s, p99 ≤ " + bound(h.p99_le_s) + " s" : "no delivery yet");
      }
    });
  }

  // The schedule's timelines (a topology with [schedule]): the bars of each queue drawn
  // again from /api/schedule, as html.py's svg_timeline draws them (bars 90 high at
  // most, baseline 110).
  function applySchedule(data) {
    var box = document.querySelector(".timelines");
    if (!box) return;
    var error = document.querySelector('[data-f="schedule-error"]');
    if (error) {
      error.hidden = !data.error;
      setText(error, data.error || "");
    }
    if (data.read_at_ms) {
      setText(document.querySelector('[data-f="schedule-read-at"]'), new Date(data.read_at_ms).toISOString());
    }
    var queues = data.queues.map(function (t) { return t.queue; }).join(",");
    if (queues !== (box.getAttribute("data-queues") || "")) {
      if (data.queues.length) window.location.reload(); // the server draws them
      return;
    }
    data.queues.forEach(function (t, i) {
      var svg = box.querySelector('[data-t="' + i + '"]');
      if (!svg) return;
      var top = Math.max.apply(null, t.buckets.map(function (b) { return b.count; })) || 1;
      t.buckets.forEach(function (b, j) {
        var rect = svg.querySelector('[data-b="' + j + '"]');
        var label = svg.querySelector('[data-c="' + j + '"]');
        var tip = svg.querySelector('[data-w="' + j + '"]');
        if (!rect) return;
        var tall = Math.round(90 * b.count / top);
        rect.setAttribute("y", String(110 - tall));
        rect.setAttribute("height", String(tall));
        if (label) {
          label.setAttribute("y", String(110 - tall - 3));
          setText(label, b.count ? String(b.count) : "");
        }
        if (tip) {
          setText(tip, b.start + " to " + new Date(b.start_ms + t.bucket_ms).toISOString() + ": " + b.count);
        }
      });
      setText(box.querySelector('[data-tc="' + i + '"]'), t.caption);
    });
    document.body.setAttribute("data-schedule-at", String(data.read_at_ms));
  }

  function pollSchedule() {
    if (!document.getElementById("schedule")) return;
    fetch("/api/schedule", { credentials: "same-origin", cache: "no-store" })
      .then(function (r) { return r.json(); })
      .then(applySchedule)
      .catch(function (err) {
        var error = document.querySelector('[data-f="schedule-error"]');
        if (error) {
          error.hidden = false;
          error.textContent = "dashboard unreachable: " + err;
        }
      });
  }

  function poll() {
    pollSchedule();
    fetch("/api/snapshot", { credentials: "same-origin", cache: "no-store" })
      .then(function (r) { return r.json(); })
      .then(applySnapshot)
      .catch(function (err) {
        var error = document.querySelector('[data-f="error"]');
        if (error) {
          error.hidden = false;
          error.textContent = "dashboard unreachable: " + err;
        }
      })
      .finally(function () { window.setTimeout(poll, Math.max(refresh, 1) * 1000); });
  }

  function result(text, ok) {
    var el = document.getElementById("result");
    if (!el) return;
    el.hidden = false;
    el.className = "result " + (ok ? "ok" : "error");
    el.textContent = text;
  }

  function showDetail(button) {
    var id = button.getAttribute("data-id");
    var row = document.querySelector('[data-detail="' + CSS.escape(id) + '"]');
    if (!row) return;
    if (!row.hidden) { row.hidden = true; return; }
    var url = "/api/parked/" + encodeURIComponent(button.getAttribute("data-queue")) + "/" +
      encodeURIComponent(id);
    fetch(url, { credentials: "same-origin" })
      .then(function (r) { return r.json(); })
      .then(function (data) {
        var cell = row.firstElementChild;
        while (cell.firstChild) cell.removeChild(cell.firstChild);
        if (data.error) {
          cell.textContent = data.error;
        } else {
          data.copies.forEach(function (copy) {
            var head = document.createElement("h3");
            head.textContent = "headers";
            var headers = document.createElement("pre");
            headers.className = "headers";
            headers.textContent = JSON.stringify(copy.headers, null, 2);
            var tbHead = document.createElement("h3");
            tbHead.textContent = "traceback";
            var tb = document.createElement("pre");
            tb.className = "traceback";
            tb.textContent = copy.traceback || "(none)";
            var bodyHead = document.createElement("h3");
            bodyHead.textContent = "body (" + copy.body.size + " bytes, " + copy.body.encoding + ")";
            var body = document.createElement("pre");
            body.className = "body";
            body.textContent = copy.body.text;
            [tbHead, tb, bodyHead, body, head, headers].forEach(function (el) { cell.appendChild(el); });
          });
        }
        row.hidden = false;
      });
  }

  function send(form) {
    var fields = new URLSearchParams(new FormData(form));
    if (form.getAttribute("data-action") === "purge") {
      var queue = form.getAttribute("data-queue");
      var answer = window.prompt("Purge " + form.getAttribute("data-total") + " message(s) parked for " +
        queue + "? They cannot be recovered. Type the queue name to confirm:");
      if (answer === null) return;
      fields.set("confirm", answer);
    }
    var headers = { "Content-Type": "application/x-www-form-urlencoded" };
    if (token) headers["X-Rabbit-Delay-Token"] = token;
    fetch(form.getAttribute("action"), {
      method: "POST", credentials: "same-origin", headers: headers, body: fields.toString()
    })
      .then(function (r) { return r.json().then(function (data) { return [r.ok, data]; }); })
      .then(function (pair) {
        var ok = pair[0], data = pair[1];
        if (!ok) { result("refused: " + data.error, false); return; }
        if ("purged" in data) {
          result("purged " + data.purged + " message(s) from " + data.parking_queue, true);
        } else {
          result("replayed " + data.moved + " message(s) to " + data.destination +
            (data.message_ids.length ? ": " + data.message_ids.slice(0, 10).join(", ") : ""), true);
        }
        document.body.setAttribute("data-done", String(Date.now()));
        window.setTimeout(function () { window.location.reload(); }, 1500);
      })
      .catch(function (err) { result("failed: " + err, false); });
  }

  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll("button.show").forEach(function (button) {
      button.addEventListener("click", function () { showDetail(button); });
    });
    document.querySelectorAll("form.action").forEach(function (form) {
      form.addEventListener("submit", function (event) {
        event.preventDefault();
        send(form);
      });
    });
    if (pageName === "overview") window.setTimeout(poll, Math.max(refresh, 1) * 1000);
    document.body.setAttribute("data-ready", "1");
  });
})();
