// Validates the Kubernetes manifests of deploy/k8s against the Kubernetes
// API schemas (kubernetes-models: each document becomes its model class and
// .validate() runs the OpenAPI schema check), then checks how the qtx pieces
// fit together: every volumeMount names a volume, every resources.claims
// entry names a pod resourceClaim, the gRPC probes hit qtxd's --health_port,
// the trainer and qtxd share the socket and /dev/shm volumes, and the MPS
// daemon's pipe folder; for a whole-node pod with one qtxd per GPU (node.yaml)
// also one GPU, socket, port set and persistent checkpoint folder per sidecar,
// exclusive whole cores that its threads fit in, IPC_LOCK and an RDMA device.
//
//   node validate.js FILE.yaml...      exit 0 when every document passes
//   node validate.js --self-test       checks that broken manifests fail
'use strict';

const fs = require('fs');
const path = require('path');
const yaml = require('js-yaml');
const models = require('kubernetes-models');

// Kinds that kubernetes-models (the release that runs on Debian 12's
// Node.js 18) has no model for: yamllint checks them, nothing else.
const NO_MODEL = new Set(['resource.k8s.io/v1 ResourceClaimTemplate']);

function modelFor(apiVersion, kind) {
  const [group, version] = apiVersion.includes('/') ? apiVersion.split('/') : ['', apiVersion];
  const key = group === '' ? version : `${group}/${version}`;
  const mod = models[key.replace(/\//g, '_')] || safeRequire(`kubernetes-models/${key}`);
  return mod ? mod[kind] : undefined;
}

function safeRequire(name) {
  try {
    return require(name);
  } catch (e) {
    return undefined;
  }
}

function podSpecOf(doc) {
  if (doc.kind === 'Pod') return doc.spec;
  if (doc.spec && doc.spec.template) return doc.spec.template.spec;
  return undefined;
}

function flagValue(args, flag) {
  for (const a of args || []) {
    if (a.startsWith(`${flag}=`)) return a.slice(flag.length + 1);
  }
  return undefined;
}

// Kubernetes CPU quantity -> number of CPUs ("16" -> 16, "500m" -> 0.5).
function cpuCount(q) {
  if (q === undefined) return undefined;
  const t = String(q);
  return t.endsWith('m') ? Number(t.slice(0, -1)) / 1000 : Number(t);
}

// The qtx-specific wiring; returns a list of problems.
function checkWiring(doc) {
  const spec = podSpecOf(doc);
  if (!spec) return [];
  const problems = [];
  const claimTemplates = ((doc.spec && doc.spec.volumeClaimTemplates) || []).map((v) => v.metadata.name);
  const volumes = new Set([...(spec.volumes || []).map((v) => v.name), ...claimTemplates]);
  const claims = new Set((spec.resourceClaims || []).map((c) => c.name));
  const all = [...(spec.initContainers || []), ...(spec.containers || [])];
  for (const c of all) {
    for (const m of c.volumeMounts || []) {
      if (!volumes.has(m.name)) problems.push(`container ${c.name}: volumeMount ${m.name} names no volume`);
    }
    for (const cl of (c.resources && c.resources.claims) || []) {
      if (!claims.has(cl.name)) problems.push(`container ${c.name}: claim ${cl.name} is not in spec.resourceClaims`);
    }
  }
  // One sidecar ("qtxd"), or one per GPU ("qtxd-0", "qtxd-1", ...).
  const qtxds = all.filter((c) => c.name === 'qtxd' || /^qtxd-\d+$/.test(c.name));
  if (qtxds.length === 0) return problems.concat(['no container named qtxd or qtxd-<i>']);
  const mountOf = (c, dir) => (c.volumeMounts || []).find((m) => dir.startsWith(m.mountPath));
  const envOf = (c, k) => ((c.env || []).find((e) => e.name === k) || {}).value;
  const mpsIdx = (spec.initContainers || []).findIndex((c) => (c.command || [])[0] === 'nvidia-cuda-mps-control');
  const mps = mpsIdx >= 0 ? spec.initContainers[mpsIdx] : undefined;
  const pipe = mps && envOf(mps, 'CUDA_MPS_PIPE_DIRECTORY');
  for (const qtxd of qtxds) {
    const healthPort = Number(flagValue(qtxd.args, '--health_port'));
    for (const p of ['startupProbe', 'readinessProbe', 'livenessProbe']) {
      const probe = qtxd[p];
      if (!probe || !probe.grpc) problems.push(`${qtxd.name}: ${p} must be a grpc probe`);
      else if (probe.grpc.port !== healthPort) problems.push(`${qtxd.name}: ${p} port ${probe.grpc.port} != --health_port ${healthPort}`);
    }
    const socket = flagValue(qtxd.args, '--socket');
    for (const c of spec.containers || []) {
      const a = socket && mountOf(c, path.dirname(socket));
      const b = socket && mountOf(qtxd, path.dirname(socket));
      if (!a || !b || a.name !== b.name) problems.push(`${c.name} and ${qtxd.name} do not share the socket folder of ${socket}`);
      const sa = mountOf(c, '/dev/shm');
      const sb = mountOf(qtxd, '/dev/shm');
      if (!sa || !sb || sa.name !== sb.name) problems.push(`${c.name} and ${qtxd.name} do not share /dev/shm`);
    }
    const listen = flagValue(qtxd.args, '--listen_tcp');
    if (listen && !/^(127\.|localhost|\[::1\])/.test(listen)) {
      for (const f of ['--tls_cert_file', '--tls_key_file', '--auth_token_file']) {
        if (!flagValue(qtxd.args, f)) problems.push(`${qtxd.name} listens on ${listen} without ${f}`);
      }
    }
    // MPS (channels): when a container runs the daemon, qtxd and every
    // container point CUDA_MPS_PIPE_DIRECTORY at one shared folder, and the
    // daemon starts before qtxd.
    if (mps) {
      const qtxdIdx = spec.initContainers.indexOf(qtxd);
      if (qtxdIdx >= 0 && qtxdIdx < mpsIdx) problems.push(`the MPS daemon must start before ${qtxd.name}`);
    }
  }
  if (mps) {
    for (const c of [...qtxds, ...(spec.containers || [])]) {
      if (envOf(c, 'CUDA_MPS_PIPE_DIRECTORY') !== pipe) problems.push(`${c.name}: CUDA_MPS_PIPE_DIRECTORY is not the MPS daemon's ${pipe}`);
      const a = pipe && mountOf(c, path.dirname(pipe));
      const b = pipe && mountOf(mps, path.dirname(pipe));
      if (!a || !b || a.name !== b.name) problems.push(`${c.name} does not share the MPS pipe folder ${pipe}`);
    }
  }
  const dshm = (spec.volumes || []).find((v) => v.name === 'dshm');
  if (!dshm || !dshm.emptyDir || dshm.emptyDir.medium !== 'Memory') problems.push('/dev/shm must be a memory-backed emptyDir');
  if (spec.shareProcessNamespace !== true) problems.push('shareProcessNamespace must be true (CUDA IPC between containers)');
  if (qtxds.length > 1) problems.push(...checkNode(doc, spec, all, qtxds, mps, claimTemplates));
  return problems;
}

// A whole-node pod with one qtxd per GPU: each sidecar on its own GPU, socket,
// ports and checkpoint folder (on a persistent volume), with exclusive cores
// (Guaranteed QoS: whole CPUs, requests == limits, in every container) that
// its threads fit in, the MPS daemon, and what NCCL over InfiniBand needs.
function checkNode(doc, spec, all, qtxds, mps, claimTemplates) {
  const problems = [];
  const distinct = (what, values) => {
    const seen = new Map();
    values.forEach((v, i) => {
      if (v === undefined) problems.push(`${qtxds[i].name}: no ${what}`);
      else if (seen.has(v)) problems.push(`${qtxds[i].name} and ${seen.get(v)} share ${what} ${v}`);
      else seen.set(v, qtxds[i].name);
    });
  };
  const devices = qtxds.map((q) => flagValue(q.args, '--device'));
  distinct('--device', devices);
  devices.forEach((d, i) => {
    if (d !== undefined && !/^cuda:\d+$/.test(d)) problems.push(`${qtxds[i].name}: --device=${d} is not one GPU (cuda:N)`);
  });
  distinct('--socket', qtxds.map((q) => flagValue(q.args, '--socket')));
  const ports = [];
  for (const q of qtxds) {
    for (const f of ['--health_port', '--metrics_port']) {
      const v = flagValue(q.args, f);
      if (v !== undefined && v !== '0') ports.push([q.name, `${f}=${v}`, v]);
    }
    const listen = flagValue(q.args, '--listen_tcp');
    if (listen) ports.push([q.name, `--listen_tcp=${listen}`, listen.split(':').pop()]);
  }
  const byPort = new Map();
  for (const [name, what, port] of ports) {
    if (byPort.has(port)) problems.push(`${name} (${what}) and ${byPort.get(port)} use the same port ${port}`);
    else byPort.set(port, `${name} (${what})`);
  }
  if (!mps) problems.push('no MPS control daemon container (stream-ordered channels need MPS)');
  // Exclusive cores: the kubelet's static CPU manager gives them only to
  // containers of Guaranteed pods that ask for whole CPUs.
  for (const c of all) {
    const r = c.resources || {};
    const req = (r.requests || {});
    const lim = (r.limits || {});
    for (const k of ['cpu', 'memory']) {
      if (req[k] === undefined || String(req[k]) !== String(lim[k])) {
        problems.push(`${c.name}: ${k} requests (${req[k]}) != limits (${lim[k]}): the pod is not Guaranteed, no exclusive cores`);
      }
    }
  }
  for (const q of qtxds) {
    const cpus = cpuCount(((q.resources || {}).limits || {}).cpu);
    if (!Number.isInteger(cpus)) {
      problems.push(`${q.name}: cpu ${cpus} is not a whole number of CPUs (no exclusive cores)`);
      continue;
    }
    const threads = Number(flagValue(q.args, '--threads') || 4);
    const opt = Number(flagValue(q.args, '--optimizer_threads') || 0);
    if (!(opt >= 1)) problems.push(`${q.name}: --optimizer_threads must be set (0 means one per core of the node, not of its share)`);
    else if (threads + opt > cpus) problems.push(`${q.name}: --threads=${threads} + --optimizer_threads=${opt} exceed its ${cpus} CPUs`);
    const caps = ((q.securityContext || {}).capabilities || {}).add || [];
    if (!caps.includes('IPC_LOCK')) problems.push(`${q.name}: needs capability IPC_LOCK (NCCL over InfiniBand pins memory)`);
    const limits = (q.resources || {}).limits || {};
    if (!Object.keys(limits).some((k) => /rdma/i.test(k))) problems.push(`${q.name}: requests no RDMA device (NCCL over InfiniBand)`);
  }
  // Checkpoints: on a persistent volume, one folder per sidecar.
  const persistent = new Set([
    ...claimTemplates,
    ...(spec.volumes || []).filter((v) => v.persistentVolumeClaim).map((v) => v.name),
  ]);
  const folders = qtxds.map((q) => {
    const dir = flagValue(q.args, '--checkpoint_dir');
    if (!dir) return undefined;
    const m = (q.volumeMounts || []).find((v) => dir.startsWith(v.mountPath));
    if (!m) {
      problems.push(`${q.name}: --checkpoint_dir=${dir} is on no volume`);
      return undefined;
    }
    if (!persistent.has(m.name)) problems.push(`${q.name}: --checkpoint_dir=${dir} is on ${m.name}, not a persistent volume`);
    return `${m.name}/${m.subPath || ''}${dir.slice(m.mountPath.length)}`;
  });
  distinct('checkpoint folder', folders);
  return problems;
}

function validateDocs(docs, where) {
  let errors = 0;
  let checked = 0;
  for (const doc of docs) {
    if (doc == null) continue;
    const id = `${where}: ${doc.kind} ${doc.metadata && doc.metadata.name}`;
    if (NO_MODEL.has(`${doc.apiVersion} ${doc.kind}`)) {
      console.log(`skip  ${id} (no schema model; yamllint only)`);
      continue;
    }
    const Model = modelFor(doc.apiVersion || '', doc.kind || '');
    if (!Model) {
      console.log(`FAIL  ${id}: no model for ${doc.apiVersion} ${doc.kind}`);
      ++errors;
      continue;
    }
    const problems = [];
    try {
      new Model(doc).validate();
    } catch (e) {
      problems.push(`schema: ${e.message}`);
    }
    problems.push(...checkWiring(doc));
    ++checked;
    if (problems.length) {
      ++errors;
      console.log(`FAIL  ${id}\n  ${problems.join('\n  ')}`);
    } else {
      console.log(`ok    ${id}`);
    }
  }
  return { errors, checked };
}

function qtxdOf(d) {
  return d.spec.initContainers.find((c) => c.name === 'qtxd');
}

function nodeSpec(d) {
  return d.spec.template.spec;
}

function nodeQtxd(d, i) {
  return nodeSpec(d).initContainers.find((c) => c.name === `qtxd-${i}`);
}

function setFlag(c, flag, value) {
  const i = c.args.findIndex((a) => a.startsWith(`${flag}=`));
  if (value === undefined) c.args.splice(i, 1);
  else c.args[i] = `${flag}=${value}`;
}

function selfTest(dir) {
  const pod = yaml.load(fs.readFileSync(path.join(dir, 'pod.yaml'), 'utf8'));
  const breakers = {
    'string port': (d) => { qtxdOf(d).ports[0].containerPort = '8081'; },
    'container without a name': (d) => { delete d.spec.containers[0].name; },
    'probe off the health port': (d) => { qtxdOf(d).livenessProbe.grpc.port = 50051; },
    'trainer off the MPS pipe': (d) => { d.spec.containers[0].env.find((e) => e.name === 'CUDA_MPS_PIPE_DIRECTORY').value = '/tmp/x'; },
    'MPS after qtxd': (d) => { d.spec.initContainers.reverse(); },
    'unknown volume': (d) => { d.spec.containers[0].volumeMounts[0].name = 'nope'; },
    'disk-backed /dev/shm': (d) => { delete d.spec.volumes.find((v) => v.name === 'dshm').emptyDir.medium; },
    'no shared PIDs': (d) => { d.spec.shareProcessNamespace = false; },
    'bad restartPolicy': (d) => { d.spec.restartPolicy = 7; },
  };
  const node = yaml.loadAll(fs.readFileSync(path.join(dir, 'node.yaml'), 'utf8'))
    .find((d) => d && d.kind === 'StatefulSet');
  const nodeBreakers = {
    'two sidecars on one GPU': (d) => { setFlag(nodeQtxd(d, 1), '--device', 'cuda:0'); },
    'sidecar on every GPU': (d) => { setFlag(nodeQtxd(d, 2), '--device', 'auto'); },
    'two sidecars on one socket': (d) => { setFlag(nodeQtxd(d, 3), '--socket', '/run/qtx/qtxd-0.sock'); },
    'two sidecars on one health port': (d) => {
      setFlag(nodeQtxd(d, 4), '--health_port', '8081');
      for (const p of ['startupProbe', 'readinessProbe', 'livenessProbe']) nodeQtxd(d, 4)[p].grpc.port = 8081;
    },
    'cpu limit above request': (d) => { nodeQtxd(d, 5).resources.limits.cpu = '32'; },
    'fractional cpus': (d) => {
      nodeQtxd(d, 5).resources.limits.cpu = '1500m';
      nodeQtxd(d, 5).resources.requests.cpu = '1500m';
    },
    'trainer not Guaranteed': (d) => { delete nodeSpec(d).containers[0].resources.limits.memory; },
    'optimizer threads over the share': (d) => { setFlag(nodeQtxd(d, 6), '--optimizer_threads', '64'); },
    'optimizer threads = every core': (d) => { setFlag(nodeQtxd(d, 6), '--optimizer_threads', undefined); },
    'checkpoints on an emptyDir': (d) => {
      nodeSpec(d).volumes.push({ name: 'scratch', emptyDir: {} });
      nodeQtxd(d, 7).volumeMounts.find((m) => m.name === 'qtx-checkpoints').name = 'scratch';
    },
    'two sidecars in one checkpoint folder': (d) => {
      nodeQtxd(d, 7).volumeMounts.find((m) => m.name === 'qtx-checkpoints').subPath = 'gpu-0';
    },
    'no IPC_LOCK': (d) => { nodeQtxd(d, 1).securityContext.capabilities.add = []; },
    'no RDMA device': (d) => {
      for (const k of ['requests', 'limits']) {
        const r = nodeQtxd(d, 2).resources[k];
        for (const key of Object.keys(r)) if (/rdma/.test(key)) delete r[key];
      }
    },
    'no MPS daemon': (d) => { nodeSpec(d).initContainers.shift(); },
    'node MPS after a sidecar': (d) => {
      const ic = nodeSpec(d).initContainers;
      ic.push(ic.shift());
    },
    'sidecar off the socket volume': (d) => {
      nodeQtxd(d, 3).volumeMounts.find((m) => m.name === 'qtx-socket').mountPath = '/run/other';
    },
    'sidecar probe off its health port': (d) => { nodeQtxd(d, 0).livenessProbe.grpc.port = 8082; },
  };
  let failed = 0;
  const cases = [
    ...Object.entries(breakers).map(([n, b]) => [n, b, pod]),
    ...Object.entries(nodeBreakers).map(([n, b]) => [n, b, node]),
  ];
  for (const [name, brk, base] of cases) {
    const d = JSON.parse(JSON.stringify(base));
    brk(d);
    const { errors } = validateDocs([d], `self-test '${name}'`);
    if (errors === 0) {
      console.log(`self-test: '${name}' was accepted`);
      ++failed;
    }
  }
  const good = validateDocs([pod, node], 'self-test baseline');
  const total = cases.length + 2;
  const bad = failed + good.errors;
  console.log(`self-test: ${total - bad} passed, ${bad} failed`);
  return bad === 0;
}

function main() {
  const args = process.argv.slice(2);
  if (args[0] === '--self-test') {
    process.exit(selfTest(args[1] || path.join(__dirname, '..')) ? 0 : 1);
  }
  let errors = 0;
  let checked = 0;
  for (const file of args) {
    const docs = yaml.loadAll(fs.readFileSync(file, 'utf8'));
    const r = validateDocs(docs, path.basename(file));
    errors += r.errors;
    checked += r.checked;
  }
  console.log(`${checked - errors} passed, ${errors} failed`);
  process.exit(errors === 0 && checked > 0 ? 0 : 1);
}

main();
