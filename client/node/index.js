// qtx Node.js client: the qtx.v1 services as @grpc/grpc-js clients, their
// stubs generated at load time from proto/ by @grpc/proto-loader.
//
//   const qtx = require('./client/node');
//   const c = qtx.connect('unix:///tmp/qtxd.sock', { token: 'secret' });
//   const resp = await c.call('quantizer', 'Quantize', { input: ..., config: ... });
//
// Inline tensor bytes are Buffers; enums are strings ('BLOCK_1D', 'E4M3');
// int64 fields are strings. A failed call rejects with the grpc-js error
// (err.code is the gRPC status code, err.details the server's message).
'use strict';

const fs = require('fs');
const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const DEFAULT_PROTO_DIR = path.resolve(__dirname, '..', '..', 'proto');

// Loads qtx/v1/*.proto from `protoDir` (default: the repo's proto/).
function load(protoDir = process.env.QTX_PROTO_DIR || DEFAULT_PROTO_DIR) {
  const dir = path.join(protoDir, 'qtx', 'v1');
  const files = fs.readdirSync(dir).filter((f) => f.endsWith('.proto')).map((f) => `qtx/v1/${f}`);
  const def = protoLoader.loadSync(files, {
    includeDirs: [protoDir],
    keepCase: true,
    longs: String,
    enums: String,
    defaults: true,
    oneofs: true,
  });
  return grpc.loadPackageDefinition(def).qtx.v1;
}

// Options: token (bearer token), rootCerts / privateKey / certChain (PEM
// Buffers: TLS when any is set), timeoutMs (default 60 s).
function connect(target, options = {}) {
  const v1 = load(options.protoDir);
  if (target.startsWith('/')) target = `unix://${target}`;
  const tls = options.rootCerts || options.privateKey || options.certChain;
  const creds = tls
    ? grpc.credentials.createSsl(options.rootCerts || null, options.privateKey || null,
                                 options.certChain || null)
    : grpc.credentials.createInsecure();
  const channelOptions = {
    'grpc.max_receive_message_length': -1,
    'grpc.max_send_message_length': -1,
  };
  const clients = {
    quantizer: new v1.Quantizer(target, creds, channelOptions),
    memory: new v1.Memory(target, creds, channelOptions),
    collective: new v1.Collective(target, creds, channelOptions),
    optimizer: new v1.Optimizer(target, creds, channelOptions),
  };
  const timeoutMs = options.timeoutMs || 60000;
  let counter = 0;
  const idPrefix = Math.random().toString(16).slice(2, 10);
  return {
    v1,
    clients,
    // Calls service.method(request) with the token and a request id.
    call(service, method, request) {
      const md = new grpc.Metadata();
      md.set('x-request-id', `${idPrefix}-${++counter}`);
      if (options.token) md.set('authorization', `Bearer ${options.token}`);
      const deadline = new Date(Date.now() + timeoutMs);
      return new Promise((resolve, reject) => {
        clients[service][method](request, md, { deadline }, (err, resp) =>
          (err ? reject(err) : resolve(resp)));
      });
    },
    close() {
      for (const c of Object.values(clients)) c.close();
    },
  };
}

// A float32 [rows, cols] tensor as an inline TensorRef.
function float32Tensor(values, rows, cols) {
  const f = Float32Array.from(values);
  return {
    dtype: 'FLOAT32',
    shape: [String(rows), String(cols)],
    inline_data: Buffer.from(f.buffer, f.byteOffset, f.byteLength),
  };
}

module.exports = { load, connect, float32Tensor, status: grpc.status, DEFAULT_PROTO_DIR };
