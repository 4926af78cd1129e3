// End-to-end test of the web demo in a real browser (Debian's chromium, driven by playwright-core).
//
// Run: node --test web-demo/test/   (after web-demo/build.sh; web-demo/test.sh does both)
// It serves web-demo/www with python's http.server on a free 127.0.0.1 port (as serve.sh
// does), loads the page, drives the controls and checks what core decided is on screen. It
// saves a 1280×800 screenshot to docs/web-demo.png.

import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync, spawn } from 'node:child_process';
import { existsSync, mkdirSync, mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { chromium } from 'playwright-core';

const here = dirname(fileURLToPath(import.meta.url));
const demoDir = resolve(here, '..');
const www = join(demoDir, 'www');
const screenshot = process.env.WEB_DEMO_SCREENSHOT ?? resolve(demoDir, '..', 'docs', 'web-demo.png');
const executablePath = process.env.CHROMIUM ?? '/usr/bin/chromium';

let server;
let baseUrl;
let context;
let page;
let profile;
const consoleErrors = [];

/** Starts python's http.server on port 0 and resolves with the port it bound. */
function startServer() {
  return new Promise((resolvePort, reject) => {
    const child = spawn('python3', ['-u', '-m', 'http.server', '0', '--bind', '127.0.0.1', '--directory', www], {
      stdio: ['ignore', 'pipe', 'pipe'],
    });
    let out = '';
    const timer = setTimeout(() => reject(new Error(`http.server did not start: ${out}`)), 15000);
    const onData = (chunk) => {
      out += chunk;
      const m = /port (\d+)/.exec(out);
      if (m) {
        clearTimeout(timer);
        child.stdout.off('data', onData);
        child.stdout.resume();
        child.stderr.resume();
        resolvePort({ child, port: Number(m[1]) });
      }
    };
    child.stdout.setEncoding('utf8');
    child.stdout.on('data', onData);
    child.on('exit', (code) => reject(new Error(`http.server exited (${code}): ${out}`)));
  });
}

async function setField(id, value) {
  await page.fill(`#${id}`, String(value));
  await page.press(`#${id}`, 'Enter');
  await page.locator(`#${id}`).blur();
}

const progress = () => page.textContent('#progress');
const stripHashes = () => page.$$eval('#strip .blk', (els) => els.map((el) => el.dataset.hash));
const tenant = () => page.textContent('#request-meta .tenant');

before(async () => {
  assert.ok(existsSync(join(www, 'pkg', 'prefixroute_web_demo_bg.wasm')), 'run web-demo/build.sh first');
  assert.ok(existsSync(executablePath), `${executablePath} missing: apt-get install -y chromium`);
  const started = await startServer();
  server = started.child;
  baseUrl = `http://127.0.0.1:${started.port}/`;
  profile = mkdtempSync(join(tmpdir(), 'prefixroute-web-demo-'));
  context = await chromium.launchPersistentContext(profile, {
    executablePath,
    headless: true,
    args: [
      '--headless', '--no-sandbox', '--disable-gpu', '--disable-background-networking',
      '--no-first-run', '--disable-quic', '--disable-component-update', '--disable-sync',
    ],
    viewport: { width: 1280, height: 800 },
  });
  page = context.pages()[0] ?? (await context.newPage());
  page.on('console', (msg) => {
    if (msg.type() === 'error') consoleErrors.push(msg.text());
  });
  page.on('pageerror', (err) => consoleErrors.push(String(err)));
  page.on('requestfailed', (req) => consoleErrors.push(`request failed: ${req.url()}`));
});

after(async () => {
  await context?.close();
  server?.kill();
  if (profile) rmSync(profile, { recursive: true, force: true });
});

describe('web demo', { concurrency: false }, () => {
  test('serves wasm as application/wasm and loads with core defaults', async () => {
    const wasm = await fetch(`${baseUrl}pkg/prefixroute_web_demo_bg.wasm`);
    assert.equal(wasm.headers.get('content-type'), 'application/wasm');
    await page.goto(baseUrl);
    await page.waitForSelector('body[data-ready="true"]', { timeout: 20000 });
    const policies = await page.$$eval('#policy option', (els) => els.map((el) => el.value));
    assert.deepEqual(policies, ['latency', 'prefix', 'prefix-only', 'least-queue', 'round-robin', 'random']);
    assert.equal(await page.inputValue('#policy'), 'latency', "core's default policy");
    assert.equal(await page.inputValue('#replicas'), '3');
    assert.equal(await page.inputValue('#seed'), '42');
    assert.equal(await progress(), '0 / 64');
    assert.ok((await stripHashes()).length > 5, 'the first request is previewed');
    assert.equal(await page.locator('#replica-cards .replica').count(), 3);
    // Every control has a label.
    const unlabelled = await page.$$eval('#settings input, #settings select, .playback select',
      (els) => els.filter((el) => el.labels.length === 0).map((el) => el.id));
    assert.deepEqual(unlabelled, []);
  });

  test('stepping shows a decision with every replica\'s prediction', async () => {
    await page.click('#step');
    await page.waitForSelector('[data-testid="winner"]');
    assert.equal(await progress(), '1 / 64');
    const winner = await page.textContent('[data-testid="winner"]');
    assert.match(winner, /^replica-[0-2]$/);
    assert.equal(await page.textContent('[data-testid="outcome"]'), 'MISS', 'the first request is cold');
    const rows = await page.$$eval('#scores tbody tr', (trs) => trs.map((tr) => ({
      columns: [...tr.querySelectorAll('[data-prediction]')].map((td) => td.dataset.prediction),
      cost: Number(tr.querySelector('[data-total]').dataset.total),
      winner: tr.classList.contains('winner'),
    })));
    assert.equal(rows.length, 3);
    for (const row of rows) {
      assert.deepEqual(row.columns, ['uncached_tokens', 'queue_ms', 'ttft_ms', 'delay_to_others_ms', 'room_ms', 'copy_credit_ms', 'caution_ms']);
      assert.ok(Number.isFinite(row.cost) && row.cost > 0);
    }
    const win = rows.find((r) => r.winner);
    assert.ok(rows.every((r) => r.cost >= win.cost * 0.98 - 1), 'the lowest predicted cost wins (up to its 2% resolution)');
    const why = await page.textContent('#verdict .why');
    assert.match(why, /is believed to hold 0 of \d+ blocks; its predicted TTFT is/);
    assert.match(await page.textContent('#verdict .core-line'), /^#0 tenant-\d+: latency -> replica-\d: match 0\/\d+ blocks, \d+ uncached tokens, queue \d+ ms, TTFT \d+ ms/);

    // Step on until a request hits the cache; its explanation names the matched blocks.
    let hit = false;
    for (let i = 0; i < 30 && !hit; i += 1) {
      await page.click('#step');
      hit = (await page.textContent('[data-testid="outcome"]')) === 'HIT';
    }
    assert.ok(hit, 'prefix routing reuses a cached prefix within 30 requests');
    assert.match(await page.textContent('#verdict .why'), /is believed to hold \d+ of \d+ blocks/);
    assert.ok(await page.locator('#replica-cards .cell.full').count() > 0, 'cache grids fill');
    assert.ok(await page.locator('#replica-cards .cell.mine').count() > 0, "the request's blocks are highlighted");
  });

  test('keyboard: arrow steps, R resets', async () => {
    await page.locator('body').click({ position: { x: 5, y: 790 } });
    const before = await progress();
    await page.keyboard.press('ArrowRight');
    assert.notEqual(await progress(), before);
    await page.keyboard.press('r');
    assert.equal(await progress(), '0 / 64');
  });

  test('changing the seed changes the trace', async () => {
    const hashes = await stripHashes();
    const first = await tenant();
    await setField('seed', 7);
    await page.waitForFunction((old) => {
      const now = [...document.querySelectorAll('#strip .blk')].map((el) => el.dataset.hash);
      return now.join() !== old;
    }, hashes.join());
    const changed = await stripHashes();
    assert.notDeepEqual(changed, hashes);
    console.log(`seed 42: ${first}, seed 7: ${await tenant()}`);
    await setField('seed', 42);
    await page.waitForFunction((old) => [...document.querySelectorAll('#strip .blk')].map((el) => el.dataset.hash).join() === old, hashes.join());
  });

  test('the browser (wasm32) generates exactly the CLI\'s trace for a seed', async (t) => {
    // Random draws go through u64 in core so that 32-bit targets agree with native builds;
    // this compares the two for real. test.sh points PREFIXROUTE_BIN at the built CLI.
    const bin = process.env.PREFIXROUTE_BIN;
    if (!bin) {
      t.skip('PREFIXROUTE_BIN is not set');
      return;
    }
    const args = ['trace', '-o', '-', '--seed', '7', '--hot', '0.3', '--requests', '40'];
    const cli = execFileSync(bin, args).toString().trim().split('\n').map((l) => JSON.parse(l));
    const browser = JSON.parse(await page.evaluate(async () => {
      const core = await import('./pkg/prefixroute_web_demo.js');
      return core.generateTrace(JSON.stringify({ seed: 7, hot: 0.3, requests: 40 }));
    }));
    assert.equal(browser.length, 40);
    assert.deepEqual(browser, cli);
  });

  test('a trace in Chinese characters is routed on its characters, as the CLI generates it', async () => {
    const bin = process.env.PREFIXROUTE_BIN;
    if (bin) {
      const args = ['trace', '-o', '-', '--seed', '7', '--requests', '20', '--script', 'han'];
      const cli = execFileSync(bin, args).toString().trim().split('\n').map((l) => JSON.parse(l));
      const browser = JSON.parse(await page.evaluate(async () => {
        const core = await import('./pkg/prefixroute_web_demo.js');
        return core.generateTrace(JSON.stringify({ seed: 7, requests: 20, script: 'han' }));
      }));
      assert.deepEqual(browser, cli);
    }
    const latin = await stripHashes();
    const rebuilt = (old) => page.waitForFunction((o) => [...document.querySelectorAll('#strip .blk')]
      .map((el) => el.dataset.hash).join() !== o, old.join());
    await page.selectOption('#script', 'han');
    await rebuilt(latin);
    assert.equal(await progress(), '0 / 64');
    await page.click('#step');
    await page.waitForSelector('[data-testid="winner"]');
    // Each character is a token: a tenant's ~360-character system prompt, not its chat headers.
    const line = await page.textContent('#verdict .core-line');
    const [, tokens] = /match 0\/\d+ blocks, (\d+) uncached tokens/.exec(line) ?? [];
    assert.ok(Number(tokens) > 200, line);
    let hit = false;
    for (let i = 0; i < 30 && !hit; i += 1) {
      await page.click('#step');
      hit = (await page.textContent('[data-testid="outcome"]')) === 'HIT';
    }
    assert.ok(hit, 'a Chinese tenant\'s cached prefix is reused within 30 requests');
    const han = await stripHashes();
    await page.selectOption('#script', 'latin');
    await rebuilt(han);
    assert.deepEqual(await stripHashes(), latin);
  });

  test('changing controls rebuilds fleet and router', async () => {
    await setField('replicas', 4);
    await page.waitForFunction(() => document.querySelectorAll('#replica-cards .replica').length === 4);
    await page.selectOption('#policy', 'round-robin');
    await page.waitForSelector('#compare tr.current[data-policy="round-robin"]');
    await page.click('#step');
    await page.click('#step');
    assert.equal(await page.textContent('[data-testid="winner"]'), 'replica-1', 'round robin rotates');
    assert.equal(await page.locator('#scores tbody tr').count(), 4);
    assert.match(await page.textContent('#verdict .why'), /Round-robin/);
    // Back to the defaults for the rest.
    await page.click('#defaults');
    await page.waitForFunction(() => document.querySelectorAll('#replica-cards .replica').length === 3);
    assert.equal(await page.inputValue('#policy'), 'latency');
    // A scoring policy shows its scorers instead, the ones it uses marked.
    await page.selectOption('#policy', 'prefix');
    await page.click('#step');
    const scored = await page.$$eval('#scores tbody tr:first-child [data-scorer]', (tds) => tds.map((td) => td.dataset.scorer));
    assert.deepEqual(scored, ['prefix', 'queue', 'kv_cache', 'no_hit_lru']);
    assert.match(await page.textContent('#verdict .why'), /Cold request/);
    await page.click('#defaults');
    await page.waitForFunction(() => document.querySelector('#policy').value === 'latency');
    // An invalid value is refused with a message, not sent to core.
    await setField('tenants', 0);
    await page.waitForSelector('#error:not([hidden])');
    assert.match(await page.textContent('#error'), /Tenants/);
    await setField('tenants', 8);
    await page.waitForSelector('#error[hidden]', { state: 'attached' });
  });

  test('a hot tenant saturates its replica, which the prefix policy sets aside', async () => {
    await page.selectOption('#policy', 'prefix');
    await setField('hot', 0.7);
    await setField('rate', 40);
    await setField('slots', 2);
    await setField('requests', 200);
    await page.waitForFunction(() => document.querySelector('#progress').textContent === '0 / 200');
    let saturated = false;
    for (let i = 0; i < 120 && !saturated; i += 1) {
      await page.click('#step');
      saturated = (await page.locator('#scores .chip.warn').count()) > 0;
    }
    assert.ok(saturated, 'some replica saturates within 120 requests');
    assert.ok(await page.locator('#scores tr.excluded').count() > 0);
    assert.match(await page.textContent('#verdict .why'), /set aside: saturated \(queue ≥ 5 or KV-cache use ≥ 80%\)/);
    await page.click('#defaults');
    await page.waitForFunction(() => document.querySelector('#progress').textContent === '0 / 64');
  });

  test('runs to the end; latency and prefix beat round robin on the same trace', async () => {
    await page.selectOption('#speed', 'max');
    await page.click('#run');
    await page.waitForFunction(() => document.querySelector('#progress').textContent === '64 / 64', null, { timeout: 30000 });
    await page.waitForSelector('#pause:disabled');
    assert.ok(await page.isDisabled('#step'));
    const hit = async (policy) => Number(await page.getAttribute(`#compare tr[data-policy="${policy}"] [data-metric="hit_rate"]`, 'data-value'));
    const latency = await hit('latency');
    const prefix = await hit('prefix');
    const rr = await hit('round-robin');
    console.log(`hit rate: latency ${(latency * 100).toFixed(1)}%, prefix ${(prefix * 100).toFixed(1)}%, round-robin ${(rr * 100).toFixed(1)}%`);
    assert.ok(latency > rr, `latency ${latency} > round-robin ${rr}`);
    assert.ok(prefix > rr, `prefix ${prefix} > round-robin ${rr}`);
    assert.equal(await page.locator('#compare tbody tr').count(), 6);
    // The live curve ends where core's simulate says the selected (latency) run ends.
    const live = await page.textContent('#live-hit');
    assert.equal(live, `${(latency * 100).toFixed(1)}%`);
    const points = await page.getAttribute('#chart polyline.live', 'points');
    assert.equal(points.trim().split(/\s+/).length, 64);
  });

  test('shows the approximate and the precise belief side by side', async () => {
    await page.waitForSelector('#beliefs tr[data-index="precise"]');
    assert.equal(await page.locator('#beliefs tbody tr').count(), 2);
    const wrong = async (index) => Number(await page.getAttribute(`#beliefs tr[data-index="${index}"] [data-metric="wrong"]`, 'data-value'));
    assert.equal(await wrong('precise'), 0, 'the replicas\' own events are never wrong');
    // Small caches whose size the replicas keep to themselves: the router's own belief
    // assumes a large cache and keeps believing what they evicted; the events still tell
    // the truth.
    await setField('cache_blocks', 20);
    await page.uncheck('#capacity_reported');
    await page.waitForFunction(() => Number(document.querySelector('#beliefs tr[data-index="approximate"] [data-metric="wrong"]')?.dataset.value) > 0);
    assert.equal(await wrong('precise'), 0);
    await page.click('#defaults');
    await page.waitForFunction(() => document.querySelector('#capacity_reported').checked);
    await page.waitForSelector('#compare tr[data-policy="latency"] [data-metric="hit_rate"]');
    await page.waitForSelector('#beliefs tr[data-index="approximate"]');
    // The approximate row is the run the rest of the page shows (the same policy and trace).
    const approximate = Number(await page.getAttribute('#beliefs tr[data-index="approximate"] [data-metric="hit_rate"]', 'data-value'));
    const latency = Number(await page.getAttribute('#compare tr[data-policy="latency"] [data-metric="hit_rate"]', 'data-value'));
    assert.equal(approximate, latency);
  });

  test('saves a 1280x800 screenshot', async () => {
    // A mid-run state tells more than the end: reset, then route 40 requests.
    await page.click('#reset');
    for (let i = 0; i < 40; i += 1) await page.keyboard.press('ArrowRight');
    await page.locator('body').click({ position: { x: 5, y: 5 } });
    await page.waitForFunction(() => document.querySelector('#progress').textContent.startsWith('40 /'));
    await page.evaluate(() => {
      window.scrollTo(0, 0);
      document.querySelector('.controls').scrollTop = 0;
    });
    mkdirSync(dirname(screenshot), { recursive: true });
    await page.screenshot({ path: screenshot });
    console.log(`screenshot: ${screenshot}`);
    if (process.env.WEB_DEMO_FULL_SCREENSHOT) {
      await page.screenshot({ path: process.env.WEB_DEMO_FULL_SCREENSHOT, fullPage: true });
    }
  });

  test('fits a narrow screen', async () => {
    const narrow = await context.newPage();
    narrow.on('console', (msg) => {
      if (msg.type() === 'error') consoleErrors.push(msg.text());
    });
    narrow.on('pageerror', (err) => consoleErrors.push(String(err)));
    await narrow.setViewportSize({ width: 390, height: 844 });
    await narrow.goto(baseUrl);
    await narrow.waitForSelector('body[data-ready="true"]');
    assert.equal(await narrow.getAttribute('#settings-panel', 'open'), null, 'settings start folded');
    for (let i = 0; i < 12; i += 1) await narrow.click('#step');
    await narrow.waitForSelector('[data-testid="winner"]');
    const overflow = await narrow.evaluate(() => document.documentElement.scrollWidth - window.innerWidth);
    assert.ok(overflow <= 1, `page scrolls sideways by ${overflow}px`);
    if (process.env.WEB_DEMO_NARROW_SCREENSHOT) {
      await narrow.screenshot({ path: process.env.WEB_DEMO_NARROW_SCREENSHOT, fullPage: true });
    }
    await narrow.close();
  });

  test('no console errors', () => {
    assert.deepEqual(consoleErrors, []);
  });
});
