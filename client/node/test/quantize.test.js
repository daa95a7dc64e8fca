// The Node.js client against a qtxd this test starts ($QTXD): quantizes
// through the proto-loader stubs and checks the FP8 bytes and scales with
// a decoder written here, plus the bearer token refusal.
//   QTXD=build/server/qtxd node --test client/node/test/
'use strict';

const test = require('node:test');
const assert = require('node:assert');
const { spawn } = require('child_process');
const fs = require('fs');
const os = require('os');
const path = require('path');
const qtx = require('..');

const TOKEN = 'node-test-token';

// E4M3 (e4m3fn) byte -> value.
function e4m3(b) {
  const sign = b & 0x80 ? -1 : 1;
  const e = (b >> 3) & 0xf;
  const m = b & 7;
  if (e === 15 && m === 7) return NaN;
  if (e === 0) return sign * (m / 8) * 2 ** -6;
  return sign * (1 + m / 8) * 2 ** (e - 7);
}

async function startQtxd() {
  assert.ok(process.env.QTXD, 'set QTXD to the qtxd executable');
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'qtx-node-'));
  const sock = path.join(dir, 'qtxd.sock');
  fs.writeFileSync(path.join(dir, 'token'), `${TOKEN}\n`);
  const proc = spawn(process.env.QTXD, [`--socket=${sock}`, '--device=cpu', '--log_level=warn',
    `--auth_token_file=${path.join(dir, 'token')}`], { stdio: 'inherit' });
  const deadline = Date.now() + 30000;
  while (Date.now() < deadline) {
    if (proc.exitCode !== null) throw new Error(`qtxd exited with ${proc.exitCode}`);
    if (fs.existsSync(sock)) {
      const c = qtx.connect(`unix://${sock}`, { token: TOKEN, timeoutMs: 2000 });
      try {
        await c.call('memory', 'ListRegions', {});
        c.close();
        return { proc, dir, target: `unix://${sock}` };
      } catch (e) {
        c.close();
      }
    }
    await new Promise((r) => setTimeout(r, 50));
  }
  proc.kill('SIGKILL');
  throw new Error('qtxd did not answer within 30 s');
}

test('quantize through qtxd from Node.js', async (t) => {
  const server = await startQtxd();
  t.after(() => {
    server.proc.kill('SIGTERM');
    fs.rmSync(server.dir, { recursive: true, force: true });
  });
  const c = qtx.connect(server.target, { token: TOKEN });
  t.after(() => c.close());

  await t.test('1x128 E4M3 rowwise + columnwise bytes', async () => {
    // Row 0: (i - 64) / 8 for i in 0..127, then 72 more columns of 0.5;
    // row 1: all zero; row 2: -3.
    const rows = 3;
    const cols = 200;
    const x = new Float32Array(rows * cols);
    for (let j = 0; j < cols; ++j) {
      x[j] = j < 128 ? (j - 64) / 8 : 0.5;
      x[cols + j] = 0;
      x[2 * cols + j] = -3;
    }
    const resp = await c.call('quantizer', 'Quantize', {
      input: qtx.float32Tensor(x, rows, cols),
      config: { scaling_mode: 'BLOCK_1D', format: 'E4M3', rowwise: true, columnwise: true },
    });
    const r = resp.result;
    assert.deepStrictEqual(r.shape, ['3', '200']);
    const data = r.rowwise_data.inline_data;
    assert.strictEqual(r.rowwise_data.dtype, 'FLOAT8_E4M3');
    assert.strictEqual(data.length, rows * cols);
    const sb = r.rowwise_scale_inv.inline_data;
    const scale = new Float32Array(sb.buffer.slice(sb.byteOffset, sb.byteOffset + sb.length));
    // [ceil(200/128)=2, pad4(3)=4]
    assert.deepStrictEqual(r.rowwise_scale_inv.shape, ['2', '4']);
    // Row 0, block 0: amax 8 -> 448/8 = 56 -> pow2 32 -> scale_inv 1/32.
    assert.strictEqual(scale[0 * 4 + 0], 1 / 32);
    // Exact bytes: 0 -> 0x00, 1 -> 32 = 0x60, -8 -> -256 = 0xF8, 7.875 -> 252 -> 256 = 0x78.
    assert.strictEqual(data[64], 0x00);
    assert.strictEqual(data[72], 0x60);
    assert.strictEqual(data[0], 0xf8);
    assert.strictEqual(data[127], 0x78);
    // Row 0, block 1 (0.5 everywhere): 448/0.5 = 896 -> 512; 0.5*512 = 256 -> 0x78.
    assert.strictEqual(scale[1 * 4 + 0], 1 / 512);
    assert.strictEqual(data[150], 0x78);
    // Row 2: -3 -> 448/3 -> 128; -384 -> 0xFC (1.5 * 2^8).
    assert.strictEqual(scale[0 * 4 + 2], 1 / 128);
    assert.strictEqual(data[2 * cols + 5], 0xfc);
    // Every element within half an FP8 step of its input.
    for (let i = 0; i < rows; ++i) {
      for (let j = 0; j < cols; ++j) {
        const s = scale[Math.floor(j / 128) * 4 + i];
        const v = x[i * cols + j];
        const got = e4m3(data[i * cols + j]) * (s === 0 ? 0 : s);
        assert.ok(Math.abs(got - v) <= Math.max(Math.abs(v) / 16, s / 1024) * 1.0001,
                  `[${i},${j}] ${v} -> ${got}`);
      }
    }
    // Columnwise copy: [200, 3], the transpose's bytes.
    assert.deepStrictEqual(r.columnwise_data.shape, ['200', '3']);
    assert.strictEqual(r.columnwise_data.inline_data.length, rows * cols);
    // Column block scales: column 5 holds -7.375, 0, -3 -> amax 7.375 -> 448/7.375 -> 32.
    const cb = r.columnwise_scale_inv.inline_data;
    const cscale = new Float32Array(cb.buffer.slice(cb.byteOffset, cb.byteOffset + cb.length));
    assert.strictEqual(cscale[5], 1 / 32);
  });

  await t.test('dequantize round trip', async () => {
    const x = new Float32Array(128 * 4).map((_, i) => Math.sin(i) * 10);
    const q = await c.call('quantizer', 'Quantize', {
      input: qtx.float32Tensor(x, 4, 128), config: { scaling_mode: 'BLOCK_2D' } });
    const d = await c.call('quantizer', 'Dequantize', { input: q.result, output_dtype: 'FLOAT32' });
    const ob = d.output.inline_data;
    const y = new Float32Array(ob.buffer.slice(ob.byteOffset, ob.byteOffset + ob.length));
    assert.strictEqual(y.length, x.length);
    for (let i = 0; i < x.length; ++i) assert.ok(Math.abs(y[i] - x[i]) <= 10 / 16 + 1e-6);
  });

  await t.test('errors keep their status codes', async () => {
    await assert.rejects(
      c.call('quantizer', 'Quantize', { input: qtx.float32Tensor([1, 2, 3], 1, 4) }),
      (e) => e.code === qtx.status.INVALID_ARGUMENT && /byte/.test(e.details));
    const anonymous = qtx.connect(server.target);
    await assert.rejects(anonymous.call('memory', 'ListRegions', {}),
      (e) => e.code === qtx.status.UNAUTHENTICATED);
    anonymous.close();
  });
});
