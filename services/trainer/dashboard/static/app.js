// The dashboard's shell: sign-in, the hash router (#/jobs, #/job/<id>, #/pool) and polling that stops with its page.
import { AuthError, api, el, session } from "./api.js";
import { renderJobs } from "./jobs.js";
import { renderJob } from "./job.js";
import { renderPool } from "./pool.js";

const POLL_MS = 2000;
let generation = 0;  // bumped on every navigation: a page's pollers stop when it is no longer shown

function showLogin(message = "") {
  document.getElementById("login").hidden = false;
  document.getElementById("main").replaceChildren();
  document.getElementById("login-error").textContent = message;
  document.getElementById("session").replaceChildren();
}

function showSession() {
  document.getElementById("login").hidden = true;
  const out = el("button", { type: "button", id: "sign-out", onclick: () => { session.token = null; showLogin(); } },
    "Sign out");
  document.getElementById("session").replaceChildren(session.token ? "signed in with a token" : "no token", out);
}

// Run `tick` now and every POLL_MS while this page is shown; `tick` returns false to stop.
function poll(tick) {
  const mine = generation;
  const loop = async () => {
    if (mine !== generation) return;
    let again = true;
    try { again = (await tick()) !== false; } catch (err) { return fail(err); }
    if (again && mine === generation) setTimeout(loop, POLL_MS);
  };
  return loop();
}

function fail(err) {
  if (err instanceof AuthError) { session.token = null; showLogin(err.message); return; }
  const box = document.getElementById("page-error");
  if (box) box.textContent = String(err.message || err);
}

async function route() {
  generation += 1;
  if (session.token === null) { showLogin(); return; }
  showSession();
  const main = document.getElementById("main");
  main.replaceChildren(el("p", { class: "error", id: "page-error" }));
  const [, page, arg] = (location.hash || "#/jobs").split("/");
  for (const link of document.querySelectorAll("header nav a")) link.classList.toggle("active", link.id === `nav-${page}`);
  const ctx = { main, poll, fail, api };
  try {
    if (page === "job" && arg) await renderJob(ctx, decodeURIComponent(arg));
    else if (page === "pool") await renderPool(ctx);
    else await renderJobs(ctx);
  } catch (err) { fail(err); }
}

document.getElementById("login").addEventListener("submit", (event) => {
  event.preventDefault();
  session.token = document.getElementById("token").value.trim();
  document.getElementById("token").value = "";
  route();
});
document.getElementById("login-none").addEventListener("click", () => { session.token = ""; route(); });
window.addEventListener("hashchange", route);
route();
