// Validates the Kubernetes manifests of deploy/k8s against the Kubernetes
// API schemas (kubernetes-models: each document becomes its model class and
// .validate() runs the OpenAPI schema check), then checks how the qtx pieces
// fit together: every volumeMount names a volume, every resources.claims
// entry names a pod resourceClaim, the gRPC probes hit qtxd's --health_port,
// and the trainer and qtxd share the socket and /dev/shm volumes.
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

// The qtx-specific wiring; returns a list of problems.
function checkWiring(doc) {
  const spec = podSpecOf(doc);
  if (!spec) return [];
  const problems = [];
  const volumes = new Set((spec.volumes || []).map((v) => v.name));
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
  const qtxd = all.find((c) => c.name === 'qtxd');
  if (!qtxd) return problems.concat(['no container named qtxd']);
  const healthPort = Number(flagValue(qtxd.args, '--health_port'));
  for (const p of ['startupProbe', 'readinessProbe', 'livenessProbe']) {
    const probe = qtxd[p];
    if (!probe || !probe.grpc) problems.push(`qtxd: ${p} must be a grpc probe`);
    else if (probe.grpc.port !== healthPort) problems.push(`qtxd: ${p} port ${probe.grpc.port} != --health_port ${healthPort}`);
  }
  const socket = flagValue(qtxd.args, '--socket');
  const mountOf = (c, dir) => (c.volumeMounts || []).find((m) => dir.startsWith(m.mountPath));
  for (const c of spec.containers || []) {
    const a = socket && mountOf(c, path.dirname(socket));
    const b = socket && mountOf(qtxd, path.dirname(socket));
    if (!a || !b || a.name !== b.name) problems.push(`${c.name} and qtxd do not share the socket folder of ${socket}`);
    const sa = mountOf(c, '/dev/shm');
    const sb = mountOf(qtxd, '/dev/shm');
    if (!sa || !sb || sa.name !== sb.name) problems.push(`${c.name} and qtxd do not share /dev/shm`);
  }
  const dshm = (spec.volumes || []).find((v) => v.name === 'dshm');
  if (!dshm || !dshm.emptyDir || dshm.emptyDir.medium !== 'Memory') problems.push('/dev/shm must be a memory-backed emptyDir');
  if (spec.shareProcessNamespace !== true) problems.push('shareProcessNamespace must be true (CUDA IPC between containers)');
  // MPS (channels): when a container runs the daemon, qtxd and every
  // container point CUDA_MPS_PIPE_DIRECTORY at one shared folder, and the
  // daemon starts before qtxd.
  const envOf = (c, k) => ((c.env || []).find((e) => e.name === k) || {}).value;
  const mpsIdx = (spec.initContainers || []).findIndex((c) => (c.command || [])[0] === 'nvidia-cuda-mps-control');
  if (mpsIdx >= 0) {
    const mps = spec.initContainers[mpsIdx];
    const pipe = envOf(mps, 'CUDA_MPS_PIPE_DIRECTORY');
    const qtxdIdx = spec.initContainers.findIndex((c) => c.name === 'qtxd');
    if (qtxdIdx >= 0 && qtxdIdx < mpsIdx) problems.push('the MPS daemon must start before qtxd');
    for (const c of [qtxd, ...(spec.containers || [])]) {
      if (envOf(c, 'CUDA_MPS_PIPE_DIRECTORY') !== pipe) problems.push(`${c.name}: CUDA_MPS_PIPE_DIRECTORY is not the MPS daemon's ${pipe}`);
      const a = pipe && mountOf(c, path.dirname(pipe));
      const b = pipe && mountOf(mps, path.dirname(pipe));
      if (!a || !b || a.name !== b.name) problems.push(`${c.name} does not share the MPS pipe folder ${pipe}`);
    }
  }
  const listen = flagValue(qtxd.args, '--listen_tcp');
  if (listen && !/^(127\.|localhost|\[::1\])/.test(listen)) {
    for (const f of ['--tls_cert_file', '--tls_key_file', '--auth_token_file']) {
      if (!flagValue(qtxd.args, f)) problems.push(`qtxd listens on ${listen} without ${f}`);
    }
  }
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
  let failed = 0;
  for (const [name, brk] of Object.entries(breakers)) {
    const d = JSON.parse(JSON.stringify(pod));
    brk(d);
    const { errors } = validateDocs([d], `self-test '${name}'`);
    if (errors === 0) {
      console.log(`self-test: '${name}' was accepted`);
      ++failed;
    }
  }
  const good = validateDocs([pod], 'self-test baseline');
  const total = Object.keys(breakers).length + 1;
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
